//! Containment of a sandboxed worker (`docs/DESIGN.md`, "Launching a worker, and
//! containing it"): what this kernel can give ([`probe`]), what the launcher prepares
//! before it forks ([`Prepared`]: everything that allocates or opens files, so the forked
//! child only makes system calls), the keeper and the worker's pre-exec set-up
//! (`keeper`), the file-system allow-list (`paths`), the environment allow-list
//! (`environment`) and the system-call policy the worker applies to itself before it runs
//! the code it serves (`syscalls`).

mod environment;
mod keeper;
mod paths;
mod probe;
mod syscalls;

pub use environment::{KEPT_ENV, KEPT_ENV_PREFIXES};
pub use probe::{probe, Containment};
pub(crate) use syscalls::apply_in_worker;

use super::Sandbox;
use crate::{Result, RpcError};
use std::os::fd::OwnedFd;
use std::process::Command;

/// What the launcher computed for one sandboxed worker before forking it.
pub(crate) struct Prepared {
    /// The landlock ruleset, built here and only enforced by the child
    /// (`landlock_restrict_self`, one system call after the fork).
    ruleset: OwnedFd,
    /// `/proc/self/uid_map` and `gid_map` lines: this user mapped to itself.
    uid_map: Vec<u8>,
    gid_map: Vec<u8>,
    namespaces: bool,
    /// Let the worker read its own `/proc/self` (a GPU worker's driver reads its maps):
    /// a rule the worker adds itself, since the supervisor's `/proc/self` is not its own.
    own_proc: bool,
}

/// Check that this machine gives what `sandbox` asks for and prepare it; a level it
/// cannot give is `RpcError::Unsupported` naming it, never a weaker worker.
pub(crate) fn prepare(sandbox: &Sandbox, program: &std::path::Path) -> Result<Prepared> {
    let have = probe();
    if sandbox.namespaces && !have.user_namespaces {
        return Err(RpcError::Unsupported(format!(
            "sandbox: this kernel does not let this process create user namespaces ({}), so the worker cannot get its own pid and network namespaces; enable them (e.g. sysctl kernel.unprivileged_userns_clone=1 or kernel.apparmor_restrict_unprivileged_userns=0) or ask for less with Sandbox.namespaces = false",
            have.user_namespaces_why
        )));
    }
    if have.landlock_abi == 0 {
        return Err(RpcError::Unsupported(
            "sandbox: this kernel has no landlock (Linux 5.13+ with CONFIG_SECURITY_LANDLOCK and landlock in the lsm= list), so a file-system allow-list cannot be enforced".into(),
        ));
    }
    if !have.seccomp {
        return Err(RpcError::Unsupported("sandbox: this kernel has no seccomp filter mode (CONFIG_SECCOMP_FILTER)".into()));
    }
    let ruleset = paths::ruleset(sandbox, program)?;
    // SAFETY: getuid and getgid cannot fail.
    let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
    Ok(Prepared {
        ruleset,
        uid_map: format!("{uid} {uid} 1\n").into_bytes(),
        gid_map: format!("{gid} {gid} 1\n").into_bytes(),
        namespaces: sandbox.namespaces,
        own_proc: sandbox.gpu,
    })
}

impl Prepared {
    /// What a zygote's child needs to make the same set-up (`zygote::request` sends it).
    pub(crate) fn for_zygote(&self) -> (std::os::fd::BorrowedFd<'_>, &[u8], &[u8], bool, bool) {
        use std::os::fd::AsFd;
        (self.ruleset.as_fd(), &self.uid_map, &self.gid_map, self.namespaces, self.own_proc)
    }
}

/// Clear `cmd`'s environment but the allow-listed variables (a sandboxed spec's zygote
/// starts with what its workers may see).
pub(crate) fn restrict_environment(cmd: &mut Command) {
    environment::restrict(cmd);
}

/// In the single-threaded child a zygote just forked for a sandboxed worker: the keeper
/// and the worker's set-up of the exec path (`keeper::confine`), then every fd but 0-2
/// and `conn` closed (nothing execs to close them). Returns in the worker.
///
/// # Safety
/// As `keeper::confine`; nothing in the process may use the closed fds again.
pub(crate) unsafe fn confine_forked(ruleset: i32, uid_map: &[u8], gid_map: &[u8], namespaces: bool, own_proc: bool, conn: i32) -> std::io::Result<()> {
    let c = keeper::Confine { ruleset, uid_map, gid_map, namespaces, own_proc };
    // SAFETY: per this function's contract.
    unsafe {
        keeper::confine(&c, conn)?;
        // No exec follows to take the worker's capabilities (in its user namespace).
        keeper::drop_all_capabilities(namespaces)?;
        keeper::close_all_but(conn);
    }
    Ok(())
}

/// Set `cmd` up to start contained: only allow-listed variables of this environment,
/// then the keeper and the worker's own set-up before exec (see `keeper`). Register this
/// after every other `pre_exec` closure that must run in the keeper too: the closures
/// registered later run in the worker only.
pub(crate) fn contain(cmd: &mut Command, prepared: Prepared, keep_fd: i32) {
    environment::restrict(cmd);
    keeper::install(cmd, prepared, keep_fd);
}
