//! The keeper and the worker's set-up before exec, run in the process the spawner thread
//! forked (`Command::pre_exec`), where only async-signal-safe system calls may be made:
//! everything that allocates was prepared before the fork (`Prepared`).
//!
//! The keeper (the forked process) creates the namespaces — a user namespace mapping only
//! this user to itself, and in it new pid, network, IPC, UTS and cgroup namespaces — and
//! forks the worker, pid 1 of the new pid namespace. It never execs: it waits for the
//! worker and exits as it did (a signal is raised again on itself), so the supervisor's
//! child, its pidfd and its exit status stand for the worker. A `SIGTERM` to the keeper
//! ends the worker: SIGKILL to pid 1, whose exit the kernel completes only once every
//! process of its namespace is gone, then the keeper's own exit — so a supervisor that
//! reaped the keeper knows that nothing the worker started is left.
//!
//! The worker, before it execs: dies with the keeper (`PR_SET_PDEATHSIG`, and a pipe's
//! hang-up for a keeper that died before the `prctl`: `getppid()` is 0 across the
//! namespace boundary), starts a session of its own, marks every fd but 0-2 and its connection close-on-exec, takes no
//! new privileges, empties its capability bounding, inheritable and ambient sets (so a
//! root caller's worker holds no capability after exec) and enforces the landlock ruleset.

use super::Prepared;
use std::io::Error;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::process::Command;

/// The namespaces every contained worker gets.
const NAMESPACES: libc::c_int =
    libc::CLONE_NEWUSER | libc::CLONE_NEWPID | libc::CLONE_NEWNET | libc::CLONE_NEWIPC | libc::CLONE_NEWUTS | libc::CLONE_NEWCGROUP;

fn check(r: libc::c_long) -> std::io::Result<()> {
    if r < 0 { Err(Error::last_os_error()) } else { Ok(()) }
}

/// Write all of `bytes` to the file at `path` (a /proc file the kernel takes in one write).
///
/// # Safety
/// Async-signal-safe (open, write, close); `path` is NUL-terminated.
unsafe fn write_proc(path: &std::ffi::CStr, bytes: &[u8]) -> std::io::Result<()> {
    // SAFETY: `path` is a valid C string.
    let fd = unsafe { libc::open(path.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC) };
    check(fd as libc::c_long)?;
    // SAFETY: `bytes` is readable for its length; `fd` is open.
    let n = unsafe { libc::write(fd, bytes.as_ptr().cast(), bytes.len()) };
    let r = if n == bytes.len() as isize { Ok(()) } else { Err(Error::last_os_error()) };
    // SAFETY: `fd` is ours.
    unsafe { libc::close(fd) };
    r
}

/// The signals the keeper waits for, blocked from before the fork so none is lost.
fn keeper_signals() -> libc::sigset_t {
    // SAFETY: sigset_t is plain data, initialised by sigemptyset.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid sigset_t.
    unsafe {
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGCHLD);
    }
    set
}

/// What the keeper and the worker's set-up use, as plain data read after the fork.
pub(crate) struct Confine<'a> {
    /// The landlock ruleset's fd (enforced by the worker).
    pub ruleset: i32,
    pub uid_map: &'a [u8],
    pub gid_map: &'a [u8],
    pub namespaces: bool,
    pub own_proc: bool,
}

/// Register the keeper and the worker's set-up on `cmd`; `keep_fd` is the worker's
/// connection (inherited across exec).
pub(super) fn install(cmd: &mut Command, prepared: Prepared, keep_fd: i32) {
    let Prepared { ruleset, uid_map, gid_map, namespaces, own_proc } = prepared;
    // SAFETY: the closure runs in the forked child before exec; `confine` is
    // async-signal-safe and allocates nothing: the maps and the ruleset were made before
    // the fork and are only read here.
    unsafe {
        cmd.pre_exec(move || {
            let c = Confine { ruleset: ruleset.as_raw_fd(), uid_map: &uid_map, gid_map: &gid_map, namespaces, own_proc };
            confine(&c, keep_fd)
        });
    }
}

/// In a freshly forked, single-threaded process: become the keeper of a worker in new
/// namespaces (never returns), and in that worker (or in this process, without
/// namespaces) make the worker's set-up and return. `keep_fd` is the worker's connection.
///
/// # Safety
/// Only in a single-threaded child of a fork, before anything else runs in it: it makes
/// only async-signal-safe system calls (unshare, open/write/close, pipe2, sigprocmask,
/// fork, prctl, poll, close_range, capset, landlock_add_rule, landlock_restrict_self,
/// sigwaitinfo, waitpid, kill, sigaction, setrlimit, _exit) and allocates nothing.
pub(crate) unsafe fn confine(c: &Confine<'_>, keep_fd: i32) -> std::io::Result<()> {
    // SAFETY: per this function's contract.
    unsafe {
        if c.namespaces {
            check(libc::unshare(NAMESPACES) as libc::c_long)?;
            // The kernel takes a mapping of the caller's own ids only with
            // setgroups denied first.
            write_proc(c"/proc/self/setgroups", b"deny")?;
            write_proc(c"/proc/self/uid_map", c.uid_map)?;
            write_proc(c"/proc/self/gid_map", c.gid_map)?;
            let mut hangup = [0; 2];
            check(libc::pipe2(hangup.as_mut_ptr(), libc::O_CLOEXEC) as libc::c_long)?;
            let waited = keeper_signals();
            let mut before: libc::sigset_t = std::mem::zeroed();
            libc::sigprocmask(libc::SIG_BLOCK, &waited, &mut before);
            // The raw system call, not libc's fork: that runs the atfork handlers, which
            // take locks another thread of the process we were forked from (a zygote's)
            // may have held at that fork, and which nobody would release here.
            let worker = libc::syscall(libc::SYS_clone, libc::SIGCHLD as libc::c_ulong, 0usize, 0usize, 0usize, 0usize) as libc::pid_t;
            check(worker as libc::c_long)?;
            if worker > 0 {
                libc::close(hangup[0]);
                keep(worker, hangup[1], &waited);
            }
            // The worker: pid 1 of the new namespace.
            libc::close(hangup[1]);
            check(libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) as libc::c_long)?;
            let mut pfd = libc::pollfd { fd: hangup[0], events: libc::POLLIN, revents: 0 };
            if libc::poll(&mut pfd, 1, 0) != 0 {
                // The keeper is gone (its end hung up): nobody would end this worker.
                libc::_exit(127);
            }
            libc::close(hangup[0]);
            libc::sigprocmask(libc::SIG_SETMASK, &before, std::ptr::null_mut());
            // A session of its own, as bubblewrap's `--new-session`: no controlling
            // terminal, so `TIOCSTI` cannot type into the host's terminal, and no
            // process group shared with anything outside.
            check(libc::setsid() as libc::c_long)?;
        }
        close_inherited(keep_fd)?;
        check(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) as libc::c_long)?;
        drop_capabilities(c.namespaces)?;
        if c.own_proc {
            allow_own_proc(c.ruleset)?;
        }
        // The ruleset fd is close-on-exec (the kernel makes it so).
        check(libc::syscall(libc::SYS_landlock_restrict_self, c.ruleset, 0))?;
        Ok(())
    }
}

/// Close every fd but 0-2 and `keep` (a worker forked from a zygote, which never execs:
/// close-on-exec would not close them).
///
/// # Safety
/// Async-signal-safe (close_range); nothing in this process may use the closed fds again.
pub(crate) unsafe fn close_all_but(keep: i32) {
    let keep = keep as libc::c_uint;
    // SAFETY: close_range on this process's own fds, per the caller's contract.
    unsafe {
        if keep > 3 {
            libc::syscall(libc::SYS_close_range, 3 as libc::c_uint, keep - 1, 0 as libc::c_uint);
        }
        libc::syscall(libc::SYS_close_range, keep.max(2) + 1, libc::c_uint::MAX, 0 as libc::c_uint);
    }
}

/// `struct landlock_path_beneath_attr` (packed, as the kernel declares it).
#[repr(C, packed)]
struct PathBeneath {
    allowed_access: u64,
    parent_fd: i32,
}

/// Add read access to this process's own `/proc/<pid>` to `ruleset` (before it is
/// enforced). Only this process's directory: `/proc` as a whole would show the host's
/// processes (their command lines), since the worker shares the host's `/proc` mount.
/// Its magic links (`root`, `cwd`, `fd/N`) reach nothing more: landlock checks the file
/// they lead to.
///
/// # Safety
/// Async-signal-safe (open, landlock_add_rule, close).
unsafe fn allow_own_proc(ruleset: i32) -> std::io::Result<()> {
    // EXECUTE | READ_FILE | READ_DIR: in every landlock ABI, so always handled.
    const READ: u64 = (1 << 0) | (1 << 2) | (1 << 3);
    const RULE_PATH_BENEATH: libc::c_long = 1;
    // SAFETY: a NUL-terminated path; the fd is closed below.
    let fd = unsafe { libc::open(c"/proc/self".as_ptr(), libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC) };
    check(fd as libc::c_long)?;
    let attr = PathBeneath { allowed_access: READ, parent_fd: fd };
    // SAFETY: `attr` is a valid rule of the type named, alive for the call.
    let added = check(unsafe { libc::syscall(libc::SYS_landlock_add_rule, ruleset, RULE_PATH_BENEATH, &attr as *const PathBeneath, 0) });
    // SAFETY: the fd opened above.
    unsafe { libc::close(fd) };
    added.map(drop)
}

/// Mark every fd but 0-2 and `keep` close-on-exec: what the host opened without
/// `O_CLOEXEC` (a library's log file, a socket) does not reach the worker.
///
/// # Safety
/// Async-signal-safe (close_range).
unsafe fn close_inherited(keep: i32) -> std::io::Result<()> {
    const CLOSE_RANGE_CLOEXEC: libc::c_uint = 1 << 2;
    let keep = keep as libc::c_uint;
    // SAFETY: close_range only changes flags of this process's fds.
    unsafe {
        if keep > 3 {
            check(libc::syscall(libc::SYS_close_range, 3 as libc::c_uint, keep - 1, CLOSE_RANGE_CLOEXEC))?;
        }
        check(libc::syscall(libc::SYS_close_range, keep.max(2) + 1, libc::c_uint::MAX, CLOSE_RANGE_CLOEXEC))
    }
}

/// Empty the bounding, ambient and inheritable capability sets: after exec the worker
/// holds no capability, even as uid 0 (its permitted set is bounded by the empty bounding
/// set). Outside a user namespace an unprivileged process has none to drop, and may not
/// drop bounding capabilities: only then is `EPERM` expected.
///
/// # Safety
/// Async-signal-safe (prctl, capget/capset).
unsafe fn drop_capabilities(in_user_namespace: bool) -> std::io::Result<()> {
    // SAFETY: per this function's contract.
    unsafe { drop_capability_sets(in_user_namespace, false) }
}

/// [`drop_capabilities`], and the effective and permitted sets emptied too: for a worker
/// that will not exec (forked from a zygote), where nothing else would empty them.
///
/// # Safety
/// Async-signal-safe (prctl, capget/capset).
pub(crate) unsafe fn drop_all_capabilities(in_user_namespace: bool) -> std::io::Result<()> {
    // SAFETY: per this function's contract.
    unsafe { drop_capability_sets(in_user_namespace, true) }
}

/// # Safety
/// Async-signal-safe (prctl, capget/capset).
unsafe fn drop_capability_sets(in_user_namespace: bool, held_too: bool) -> std::io::Result<()> {
    // SAFETY: prctl with integer arguments.
    unsafe {
        check(libc::prctl(libc::PR_CAP_AMBIENT, libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong, 0, 0, 0) as libc::c_long)?;
        for cap in 0..64 {
            if libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0) != 0 {
                match *libc::__errno_location() {
                    libc::EINVAL => break, // past the last capability this kernel has
                    libc::EPERM if !in_user_namespace && libc::geteuid() != 0 => break,
                    e => return Err(Error::from_raw_os_error(e)),
                }
            }
        }
    }
    #[repr(C)]
    struct Header {
        version: u32,
        pid: libc::c_int,
    }
    #[repr(C)]
    #[derive(Clone, Copy)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    const VERSION_3: u32 = 0x2008_0522;
    let mut header = Header { version: VERSION_3, pid: 0 };
    let mut data = [Data { effective: 0, permitted: 0, inheritable: 0 }; 2];
    // SAFETY: header and two data words, as capget's version 3 takes them.
    unsafe {
        check(libc::syscall(libc::SYS_capget, &mut header as *mut Header, data.as_mut_ptr()))?;
        for d in &mut data {
            d.inheritable = 0;
            if held_too {
                d.effective = 0;
                d.permitted = 0;
            }
        }
        check(libc::syscall(libc::SYS_capset, &mut header as *mut Header, data.as_ptr()))
    }
}

/// The keeper: wait for the worker and end as it did; a `SIGTERM` ends the worker first.
/// Every other fd is closed so nothing (the exec-status pipe of `Command`, the output
/// pipes) is held open by a process that never execs, and the supervisor's large memory
/// is let go (`release_supervisor_memory`).
///
/// # Safety
/// Async-signal-safe; never returns.
unsafe fn keep(worker: libc::pid_t, hangup: i32, waited: &libc::sigset_t) -> ! {
    // SAFETY: async-signal-safe system calls on this process's own fds, memory, signals
    // and child.
    unsafe {
        release_supervisor_memory();
        if hangup > 0 {
            libc::syscall(libc::SYS_close_range, 0 as libc::c_uint, (hangup - 1) as libc::c_uint, 0 as libc::c_uint);
        }
        libc::syscall(libc::SYS_close_range, (hangup + 1) as libc::c_uint, libc::c_uint::MAX, 0 as libc::c_uint);
        loop {
            let mut info: libc::siginfo_t = std::mem::zeroed();
            let sig = libc::sigwaitinfo(waited, &mut info);
            let mut status = 0;
            let reaped = if sig == libc::SIGTERM {
                libc::kill(worker, libc::SIGKILL);
                libc::waitpid(worker, &mut status, 0)
            } else {
                libc::waitpid(worker, &mut status, libc::WNOHANG)
            };
            if reaped == worker {
                end_as(status);
            }
        }
    }
}

/// Exit as the worker did: its status, or killed by its signal (raised again here,
/// without a core file of the keeper).
///
/// # Safety
/// Async-signal-safe; never returns.
unsafe fn end_as(status: libc::c_int) -> ! {
    // SAFETY: async-signal-safe calls on this process only.
    unsafe {
        if libc::WIFSIGNALED(status) {
            let sig = libc::WTERMSIG(status);
            let no_core = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
            libc::setrlimit(libc::RLIMIT_CORE, &no_core);
            let mut dfl: libc::sigaction = std::mem::zeroed();
            dfl.sa_sigaction = libc::SIG_DFL;
            libc::sigaction(sig, &dfl, std::ptr::null_mut());
            let mut only: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut only);
            libc::sigaddset(&mut only, sig);
            libc::sigprocmask(libc::SIG_UNBLOCK, &only, std::ptr::null_mut());
            libc::kill(libc::getpid(), sig);
            libc::_exit(128 + sig);
        }
        libc::_exit(libc::WEXITSTATUS(status))
    }
}

/// Mappings at least this large are let go by the keeper.
const RELEASE_AT_LEAST: usize = 1 << 20;

/// Let go of the keeper's copy of the supervisor's large private anonymous memory (heaps,
/// tensors), all but the stack it runs on. A fork shares the parent's pages
/// copy-on-write; a keeper that kept them for the worker's whole life would make every
/// page the supervisor writes afterwards a copy, and hold the old one. `MADV_DONTNEED`
/// drops the keeper's references, so the supervisor's pages are its own again. The keeper
/// itself touches only its stack and the C library's code after this.
///
/// # Safety
/// Async-signal-safe (open, read, close, madvise); allocates nothing (stack buffers).
unsafe fn release_supervisor_memory() {
    let local = 0u8;
    let sp = &local as *const u8 as usize;
    // SAFETY: a valid C string; the fd is closed below.
    let fd = unsafe { libc::open(c"/proc/self/maps".as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
    if fd < 0 {
        return;
    }
    let mut buf = [0u8; 8192];
    let mut line = [0u8; 512];
    let mut len = 0usize;
    loop {
        // SAFETY: `buf` is writable for its length.
        let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
        if n <= 0 {
            break;
        }
        for &b in &buf[..n as usize] {
            if b != b'\n' {
                if len < line.len() {
                    line[len] = b;
                    len += 1;
                }
                continue;
            }
            if let Some((start, end)) = releasable(&line[..len], sp) {
                // SAFETY: a private anonymous mapping of this process that the keeper's
                // code does not use; its contents are not read again.
                unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_DONTNEED) };
            }
            len = 0;
        }
    }
    // SAFETY: our fd.
    unsafe { libc::close(fd) };
}

/// `(start, end)` of a `/proc/self/maps` line naming a private, writable, anonymous
/// mapping of at least `RELEASE_AT_LEAST` bytes that does not hold `sp`.
fn releasable(line: &[u8], sp: usize) -> Option<(usize, usize)> {
    let mut fields = line.split(|&b| b == b' ').filter(|f| !f.is_empty());
    let range = fields.next()?;
    let perms = fields.next()?;
    let (_offset, _dev, inode) = (fields.next()?, fields.next()?, fields.next()?);
    let path = fields.next();
    let dash = range.iter().position(|&b| b == b'-')?;
    let (start, end) = (hex(&range[..dash])?, hex(&range[dash + 1..])?);
    let anonymous = inode == b"0" && path.is_none_or(|p| p == b"[heap]");
    let private_writable = perms.len() >= 4 && perms[1] == b'w' && perms[3] == b'p';
    (anonymous && private_writable && end - start >= RELEASE_AT_LEAST && !(start..end).contains(&sp)).then_some((start, end))
}

fn hex(digits: &[u8]) -> Option<usize> {
    let mut v = 0usize;
    for &d in digits {
        let x = (d as char).to_digit(16)? as usize;
        v = v.checked_mul(16)?.checked_add(x)?;
    }
    Some(v)
}

#[cfg(test)]
mod tests {
    use super::releasable;

    #[test]
    fn only_large_private_writable_anonymous_mappings_off_the_stack_are_released() {
        let big = b"7f0000000000-7f0000200000 rw-p 00000000 00:00 0 ";
        assert_eq!(releasable(big, 0x1000), Some((0x7f00_0000_0000, 0x7f00_0020_0000)));
        assert_eq!(releasable(b"7f0000000000-7f0000200000 rw-p 00000000 00:00 0", 0x1000), Some((0x7f00_0000_0000, 0x7f00_0020_0000)));
        assert_eq!(releasable(b"55d000000000-55d000400000 rw-p 00000000 00:00 0    [heap]", 0), Some((0x55d0_0000_0000, 0x55d0_0040_0000)));
        assert_eq!(releasable(big, 0x7f00_0010_0000), None, "the stack it runs on");
        assert_eq!(releasable(b"7f0000000000-7f0000001000 rw-p 00000000 00:00 0", 0), None, "small");
        assert_eq!(releasable(b"7f0000000000-7f0000200000 r--p 00000000 00:00 0", 0), None, "read-only");
        assert_eq!(releasable(b"7f0000000000-7f0000200000 rw-s 00000000 00:05 1234 /memfd:x (deleted)", 0), None, "shared");
        assert_eq!(releasable(b"7f0000000000-7f0000200000 rw-p 00001000 08:01 99 /usr/lib/libc.so.6", 0), None, "a file's data");
        assert_eq!(releasable(b"7ffd00000000-7ffd00200000 rw-p 00000000 00:00 0 [stack]", 0), None, "the main stack");
    }
}
