//! What containment this kernel gives this process: user namespaces (for the pid and
//! network namespaces), landlock's ABI (which file-system rights and scopes it can
//! enforce), seccomp's filter mode. Checked once per process; `python -m tensorwire
//! doctor` prints it, and the launcher refuses a sandbox the machine cannot give.

use std::sync::OnceLock;

/// What this machine gives (see [`probe`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Containment {
    /// This process may create a user namespace, and in it pid, network, IPC, UTS and
    /// cgroup namespaces.
    pub user_namespaces: bool,
    /// Why not, when not (the error of the attempt).
    pub user_namespaces_why: String,
    /// Landlock's ABI version (0: none). 1 file rights, 3 truncate, 4 TCP, 5 device
    /// ioctls, 6 abstract-socket and signal scopes.
    pub landlock_abi: u32,
    /// seccomp's filter mode is there.
    pub seccomp: bool,
}

impl Containment {
    /// Landlock's signal and abstract Unix socket scopes (ABI 6).
    pub fn landlock_scopes(&self) -> bool {
        self.landlock_abi >= 6
    }
}

/// What this kernel gives, checked once per process.
pub fn probe() -> Containment {
    static PROBED: OnceLock<Containment> = OnceLock::new();
    PROBED
        .get_or_init(|| {
            let (user_namespaces, user_namespaces_why) = match try_namespaces() {
                Ok(()) => (true, String::new()),
                Err(why) => (false, why),
            };
            Containment { user_namespaces, user_namespaces_why, landlock_abi: landlock_abi(), seccomp: seccomp_filters() }
        })
        .clone()
}

const NAMESPACES: libc::c_int =
    libc::CLONE_NEWUSER | libc::CLONE_NEWPID | libc::CLONE_NEWNET | libc::CLONE_NEWIPC | libc::CLONE_NEWUTS | libc::CLONE_NEWCGROUP;

/// Whether a child of this process can create the namespaces a worker gets (a user
/// namespace can be refused by sysctl, by AppArmor, or by a seccomp filter this process
/// already runs under).
fn try_namespaces() -> Result<(), String> {
    // SAFETY: the child calls only unshare and _exit (async-signal-safe) and never
    // returns into Rust; the parent waits for it.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(format!("fork: {}", std::io::Error::last_os_error()));
    }
    if pid == 0 {
        // SAFETY: see above.
        unsafe {
            let r = libc::unshare(NAMESPACES);
            let errno = if r == 0 { 0 } else { *libc::__errno_location() };
            libc::_exit(errno.min(255));
        }
    }
    let mut status = 0;
    // SAFETY: `pid` is our child; `status` is writable.
    while unsafe { libc::waitpid(pid, &mut status, 0) } < 0 {
        if std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            return Err(format!("waitpid: {}", std::io::Error::last_os_error()));
        }
    }
    match (libc::WIFEXITED(status), libc::WEXITSTATUS(status)) {
        (true, 0) => Ok(()),
        (true, errno) => Err(format!("unshare(CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET | ...): {}", std::io::Error::from_raw_os_error(errno))),
        _ => Err(format!("the probe process ended with wait status {status:#x}")),
    }
}

fn landlock_abi() -> u32 {
    const LANDLOCK_CREATE_RULESET_VERSION: libc::c_uint = 1;
    // SAFETY: with a null attribute and size 0 this only returns the ABI version.
    let r = unsafe { libc::syscall(libc::SYS_landlock_create_ruleset, std::ptr::null::<u8>(), 0usize, LANDLOCK_CREATE_RULESET_VERSION) };
    if r < 0 { 0 } else { r as u32 }
}

fn seccomp_filters() -> bool {
    const SECCOMP_GET_ACTION_AVAIL: libc::c_uint = 2;
    let action: u32 = libc::SECCOMP_RET_ERRNO;
    // SAFETY: reads the 4-byte action it is given; changes nothing.
    unsafe { libc::syscall(libc::SYS_seccomp, SECCOMP_GET_ACTION_AVAIL, 0, &action as *const u32) == 0 }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_probe_answers_and_is_stable() {
        let a = super::probe();
        assert_eq!(a, super::probe());
        if !a.user_namespaces {
            assert!(!a.user_namespaces_why.is_empty(), "a refusal says why");
        }
    }
}
