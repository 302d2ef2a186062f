//! The escape suite: hostile code in a sandboxed worker tries every class of attack of
//! `docs/DESIGN.md`'s containment table — other programs (Unix sockets by path and by
//! abstract name, TCP), signals and the process tree (signalling, re-nicing, pinning and
//! `prlimit` of another process, descendants that outlive the worker), secrets and
//! inherited state (environment, fds, keyring, files beside the host), the kernel's
//! surface (namespaces, bpf, perf, `clone3`, x32 and `int 0x80`, capabilities, `TIOCSTI`)
//! — and each must be refused or contained. The same attacks from an unsandboxed worker
//! succeed, which is what shows that each refusal is the sandbox's. Run as root, and
//! (from root) again with the supervisor as an unprivileged user.
//!
//! Every process is this test binary in a child role
//! (`tensorwire_test_support::RoleCommand`): a worker is `worker_entry` as `attacker`; the
//! unprivileged run and the supervisor-death test run `supervisor_entry` as
//! `supervisor <mode>`.

use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixListener;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use tensorwire_rpc::worker::{self, Sandbox};
use tensorwire_rpc::*;
use tensorwire_test_support::{RoleCommand, role};

const SECRET: &str = "TW_CONTAIN_TEST_SECRET";
const LEAKED_FD: i32 = 900;

fn spec() -> WorkerSpec {
    let child = RoleCommand::new("attacker").test("worker_entry").quiet();
    child
        .vars()
        .into_iter()
        .fold(WorkerSpec::new(RoleCommand::program()).args(child.argv()), |s, (k, v)| s.env(k, v))
        .handshake_timeout(Duration::from_secs(30))
        .call_timeout(Duration::from_secs(30))
}

fn sandboxed() -> WorkerSpec {
    spec().sandbox(Sandbox::default())
}

fn serial() -> std::sync::MutexGuard<'static, ()> {
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    static SECRET_SET: std::sync::Once = std::sync::Once::new();
    let guard = ONE.lock().unwrap_or_else(|e| e.into_inner());
    // SAFETY: set once, under the lock every test of this binary takes before it starts a
    // thread or a process that could read the environment concurrently.
    SECRET_SET.call_once(|| unsafe { std::env::set_var(SECRET, "hunter2") });
    guard
}

fn errno() -> std::io::Error {
    std::io::Error::last_os_error()
}

/// `refused: <why>` when `r` failed with one of `by` (the sandbox's answers), else
/// `escaped: ...`: a call that reached the kernel and failed for another reason
/// (`EINVAL` for junk arguments) was not stopped by the sandbox.
fn outcome(r: libc::c_long, by: &[i32]) -> String {
    if r >= 0 {
        return format!("escaped: it returned {r}");
    }
    let e = errno();
    if by.contains(&e.raw_os_error().unwrap_or(0)) { format!("refused: {e}") } else { format!("escaped: it reached the kernel ({e})") }
}

fn s(v: &Value) -> String {
    v.as_str().unwrap_or_default().to_string()
}

fn n(v: &Value) -> i64 {
    v.as_i64().unwrap()
}

/// The attacks, each a method of the worker's service answering `refused: ...` or
/// `escaped: ...`.
fn attacks() -> Service {
    let attack = |f: fn(&Args) -> String| move |_: &CallCtx, a: Args| -> Result<Value> { Ok(Value::Str(f(&a))) };
    Service::new("Attacker")
        .method_inline("pid", |_, _| Ok(Value::Int(i64::from(std::process::id()))))
        .method("exit", |_, _| std::process::exit(0))
        .method("sleep", |_, a| {
            std::thread::sleep(Duration::from_secs_f64(a.req(0, "s")?.as_f64().unwrap()));
            Ok(Value::Null)
        })
        .method("unix_path", attack(|a| {
            match std::os::unix::net::UnixStream::connect(s(a.req(0, "path").unwrap())) {
                Ok(_) => "escaped: connected".into(),
                Err(e) => format!("refused: {e}"),
            }
        }))
        .method("unix_abstract", attack(|a| {
            use std::os::linux::net::SocketAddrExt;
            let addr = std::os::unix::net::SocketAddr::from_abstract_name(s(a.req(0, "name").unwrap())).unwrap();
            match std::os::unix::net::UnixStream::connect_addr(&addr) {
                Ok(_) => "escaped: connected".into(),
                Err(e) => format!("refused: {e}"),
            }
        }))
        .method("tcp", attack(|a| match std::net::TcpStream::connect(("127.0.0.1", n(a.req(0, "port").unwrap()) as u16)) {
            Ok(_) => "escaped: connected".into(),
            Err(e) => format!("refused: {e}"),
        }))
        .method("signal", attack(|a| {
            let (pid, sig) = (n(a.req(0, "pid").unwrap()) as i32, n(a.req(1, "sig").unwrap()) as i32);
            // SAFETY: kill with integers; the target is the test's sacrificial process.
            let r = unsafe { libc::kill(pid, sig) };
            outcome(r as _, &[libc::EPERM, libc::ESRCH])
        }))
        .method("renice", attack(|a| {
            let pid = n(a.req(0, "pid").unwrap()) as u32;
            // SAFETY: setpriority with integers.
            let r = unsafe { libc::setpriority(libc::PRIO_PROCESS, pid, 19) };
            outcome(r as _, &[libc::EPERM, libc::ESRCH])
        }))
        .method("pin", attack(|a| {
            let pid = n(a.req(0, "pid").unwrap()) as i32;
            // SAFETY: cpu_set_t is plain data; all zeroes is the empty set.
            let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
            // SAFETY: CPU 0 is within the set's size.
            unsafe { libc::CPU_SET(0, &mut set) };
            // SAFETY: `set` is a valid cpu_set_t of the size given.
            let r = unsafe { libc::sched_setaffinity(pid, std::mem::size_of_val(&set), &set) };
            outcome(r as _, &[libc::EPERM, libc::ESRCH])
        }))
        .method("prlimit", attack(|a| {
            let pid = n(a.req(0, "pid").unwrap()) as i32;
            let one = libc::rlimit { rlim_cur: 1, rlim_max: 1 };
            // SAFETY: `one` outlives the call; no old limit is read back.
            let r = unsafe { libc::prlimit(pid, libc::RLIMIT_NOFILE, &one, std::ptr::null_mut()) };
            outcome(r as _, &[libc::EPERM, libc::ESRCH])
        }))
        .method("escapee", attack(|a| {
            // A grandchild in a session of its own (setsid's answer ignored, as an
            // attacker would), named so the test can look for it after the worker ends.
            let name = std::ffi::CString::new(s(a.req(0, "name").unwrap())).unwrap();
            // SAFETY: the children call only setsid, fork, prctl, pause and _exit
            // (async-signal-safe) and never return into Rust.
            match unsafe { libc::fork() } {
                // SAFETY: as above.
                0 => unsafe {
                    libc::setsid();
                    if libc::fork() == 0 {
                        libc::prctl(libc::PR_SET_NAME, name.as_ptr());
                        loop {
                            libc::pause();
                        }
                    }
                    libc::_exit(0)
                },
                pid if pid > 0 => {
                    // SAFETY: `pid` is our child.
                    unsafe { libc::waitpid(pid, std::ptr::null_mut(), 0) };
                    "started".into()
                }
                _ => format!("refused: fork: {}", errno()),
            }
        }))
        .method("env", attack(|a| match std::env::var(s(a.req(0, "key").unwrap())) {
            Ok(v) => format!("escaped: {v}"),
            Err(_) => "refused: not set".into(),
        }))
        .method("fd", attack(|a| {
            let fd = n(a.req(0, "fd").unwrap()) as i32;
            // SAFETY: F_GETFD only reads the fd's flags.
            let r = unsafe { libc::fcntl(fd, libc::F_GETFD) };
            outcome(r as _, &[libc::EBADF])
        }))
        .method("read", attack(|a| match std::fs::read(s(a.req(0, "path").unwrap())) {
            Ok(b) => format!("escaped: read {} bytes", b.len()),
            Err(e) => format!("refused: {e}"),
        }))
        .method("keyring", attack(|_| {
            let payload = b"planted";
            const KEY_SPEC_USER_KEYRING: i32 = -4;
            // SAFETY: add_key with C strings and a payload that outlive the call.
            let r = unsafe { libc::syscall(libc::SYS_add_key, c"user".as_ptr(), c"tw-contain".as_ptr(), payload.as_ptr(), payload.len(), KEY_SPEC_USER_KEYRING) };
            let said = outcome(r, &[libc::EPERM]);
            if r >= 0 {
                const KEYCTL_INVALIDATE: i32 = 21;
                // SAFETY: keyctl with integers: the planted key does not outlive the test.
                unsafe { libc::syscall(libc::SYS_keyctl, KEYCTL_INVALIDATE, r) };
            }
            said
        }))
        .method("userns", attack(|_| {
            // SAFETY: unshare with a flag; on success only this worker moves.
            let r = unsafe { libc::unshare(libc::CLONE_NEWUSER) };
            outcome(r as _, &[libc::EPERM])
        }))
        .method("clone_ns", attack(|_| {
            // SAFETY: a fork-like clone (no CLONE_VM): the child only calls _exit.
            let r = unsafe { libc::syscall(libc::SYS_clone, (libc::CLONE_NEWUSER | libc::SIGCHLD) as libc::c_ulong, 0usize, 0usize, 0usize, 0usize) };
            if r == 0 {
                // SAFETY: in the child: leave at once.
                unsafe { libc::_exit(0) };
            }
            if r > 0 {
                // SAFETY: `r` is our child.
                unsafe { libc::waitpid(r as i32, std::ptr::null_mut(), 0) };
            }
            outcome(r, &[libc::EPERM])
        }))
        .method("clone3", attack(|_| {
            // SAFETY: junk arguments (a null pointer, size 0): a kernel that reads them
            // answers EINVAL or EFAULT, the sandbox ENOSYS.
            let r = unsafe { libc::syscall(libc::SYS_clone3, std::ptr::null::<u8>(), 0usize) };
            outcome(r, &[libc::ENOSYS])
        }))
        .method("bpf", attack(|_| {
            const BPF_PROG_LOAD: i32 = 5;
            // SAFETY: a null attribute of size 0: the kernel reads nothing.
            let r = unsafe { libc::syscall(libc::SYS_bpf, BPF_PROG_LOAD, std::ptr::null::<u8>(), 0u32) };
            outcome(r, &[libc::EPERM])
        }))
        .method("perf", attack(|_| {
            // SAFETY: a null attribute: the kernel answers EFAULT if it gets that far.
            let r = unsafe { libc::syscall(libc::SYS_perf_event_open, std::ptr::null::<u8>(), 0, -1, -1, 0) };
            outcome(r, &[libc::EPERM])
        }))
        .method("setsid", attack(|_| {
            // SAFETY: no arguments.
            let r = unsafe { libc::setsid() };
            outcome(r as _, &[libc::EPERM])
        }))
        .method("x32", attack(|_| {
            // getpid through the x32 table: a filter that lists numbers but not the x32
            // bit passes it on (a kernel without x32 answers ENOSYS: reached it).
            // SAFETY: getpid takes no arguments.
            let r = unsafe { libc::syscall(0x4000_0000 | libc::SYS_getpid) };
            outcome(r, &[libc::EPERM])
        }))
        .method("int80", attack(|_| int80()))
        .method("caps", attack(|_| {
            let mut bounding = 0u64;
            for cap in 0..64 {
                // SAFETY: prctl with integers; only reads.
                match unsafe { libc::prctl(libc::PR_CAPBSET_READ, cap as libc::c_ulong, 0, 0, 0) } {
                    1 => bounding |= 1 << cap,
                    0 => {}
                    _ => break,
                }
            }
            #[repr(C)]
            struct Header {
                version: u32,
                pid: i32,
            }
            let mut h = Header { version: 0x2008_0522, pid: 0 };
            let mut d = [0u32; 6];
            // SAFETY: version 3 header and two data words (six u32), as capget takes them.
            unsafe { libc::syscall(libc::SYS_capget, &mut h as *mut Header, d.as_mut_ptr()) };
            if bounding == 0 && d.iter().all(|w| *w == 0) { "refused: no capability".into() } else { format!("escaped: bounding {bounding:#x}, sets {d:x?}") }
        }))
        .method("tiocsti", attack(|_| {
            let c = b'x';
            // SAFETY: TIOCSTI reads one byte from `c`.
            let r = unsafe { libc::ioctl(2, libc::TIOCSTI, &c) };
            outcome(r as _, &[libc::EPERM, libc::EIO, libc::ENOTTY, libc::EBADF])
        }))
}

#[cfg(target_arch = "x86_64")]
fn int80() -> String {
    let mut ret: i64 = 20; // getpid in the i386 table
    // SAFETY: the i386 getpid takes no arguments and changes nothing; a sandbox's
    // architecture check kills the process instead.
    unsafe { std::arch::asm!("int 0x80", inout("rax") ret, options(nostack)) };
    if ret > 0 { format!("escaped: the i386 getpid answered {ret}") } else { format!("refused: {ret}") }
}

#[cfg(not(target_arch = "x86_64"))]
fn int80() -> String {
    "refused: no i386 entry on this architecture".into()
}

#[test]
fn worker_entry() {
    if role().as_deref() != Some("attacker") {
        return;
    }
    let reg = Registry::new();
    reg.register("a", attacks()).unwrap();
    let r = worker::serve(reg, RpcConfig::default());
    std::process::exit(if r.is_ok() { 0 } else { 70 });
}

/// What the attacks aim at: a sacrificial process of the host's user, a Unix socket by
/// path and by abstract name, a TCP port, an fd without close-on-exec, a file beside the
/// host.
struct Targets {
    victim: std::process::Child,
    path: std::path::PathBuf,
    _unix: UnixListener,
    abstract_name: String,
    _abstract: UnixListener,
    tcp: std::net::TcpListener,
    leaked: std::fs::File,
}

impl Targets {
    fn new() -> Targets {
        let victim = Command::new("sleep").arg("120").spawn().unwrap();
        let tag = format!("tw-contain-{}-{}", std::process::id(), victim.id());
        let path = std::env::temp_dir().join(format!("{tag}.sock"));
        let _ = std::fs::remove_file(&path);
        let _unix = UnixListener::bind(&path).unwrap();
        use std::os::linux::net::SocketAddrExt;
        let _abstract = UnixListener::bind_addr(&std::os::unix::net::SocketAddr::from_abstract_name(tag.as_bytes()).unwrap()).unwrap();
        let tcp = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        // An fd a careless library left inheritable, at a number the worker's own files
        // will not reach.
        let devnull = std::fs::File::open("/dev/null").unwrap();
        // SAFETY: dup2 onto an fd number this process does not use (checked first).
        let leaked = unsafe {
            assert!(libc::fcntl(LEAKED_FD, libc::F_GETFD) < 0, "fd {LEAKED_FD} is in use");
            assert_eq!(libc::dup2(devnull.as_raw_fd(), LEAKED_FD), LEAKED_FD);
            <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(LEAKED_FD)
        };
        Targets { victim, path, _unix, abstract_name: tag, _abstract, tcp, leaked }
    }

    fn victim_state(&self) -> (char, String) {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.victim.id())).unwrap();
        let after = &stat[stat.rfind(')').unwrap() + 2..];
        let fields: Vec<&str> = after.split_whitespace().collect();
        let limits = std::fs::read_to_string(format!("/proc/{}/limits", self.victim.id())).unwrap();
        let nofile = limits.lines().find(|l| l.starts_with("Max open files")).unwrap_or("").to_string();
        (fields[0].chars().next().unwrap(), format!("nice {} {nofile}", fields[16]))
    }
}

impl Drop for Targets {
    fn drop(&mut self) {
        let _ = self.victim.kill();
        let _ = self.victim.wait();
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Every attack from `w` against `t`: (attack, outcome).
fn attack_all(w: &Worker, t: &Targets) -> Vec<(String, String)> {
    let victim = i64::from(t.victim.id());
    let cases: Vec<(&str, &str, Vec<Value>)> = vec![
        ("unix socket by path", "unix_path", vec![t.path.display().to_string().into()]),
        ("unix socket by abstract name", "unix_abstract", vec![t.abstract_name.clone().into()]),
        ("tcp to the host", "tcp", vec![i64::from(t.tcp.local_addr().unwrap().port()).into()]),
        ("SIGSTOP another process", "signal", vec![victim.into(), i64::from(libc::SIGSTOP).into()]),
        ("re-nice another process", "renice", vec![victim.into()]),
        ("pin another process", "pin", vec![victim.into()]),
        ("prlimit another process", "prlimit", vec![victim.into()]),
        ("the host's environment", "env", vec![SECRET.into()]),
        ("an inherited fd", "fd", vec![i64::from(t.leaked.as_raw_fd()).into()]),
        ("a file beside the host", "read", vec![std::env::current_dir().unwrap().join("Cargo.toml").display().to_string().into()]),
        ("a host file", "read", vec!["/etc/hostname".into()]),
        ("the user keyring", "keyring", vec![]),
        ("a user namespace", "userns", vec![]),
        ("clone into new namespaces", "clone_ns", vec![]),
        ("clone3", "clone3", vec![]),
        ("bpf", "bpf", vec![]),
        ("perf_event_open", "perf", vec![]),
        ("setsid", "setsid", vec![]),
        ("an x32 system call", "x32", vec![]),
        ("capabilities", "caps", vec![]),
        ("TIOCSTI into the terminal", "tiocsti", vec![]),
    ];
    let mut out: Vec<(String, String)> =
        cases.into_iter().map(|(what, m, args)| (what.to_string(), s(&w.call("a", m, args).unwrap_or_else(|e| panic!("{what}: {e}"))))).collect();
    let (state, sched) = t.victim_state();
    out.push(("the victim afterwards".into(), if state == 'S' { format!("refused: sleeping, {sched}") } else { format!("escaped: state {state}") }));
    out
}

fn escaped(results: &[(String, String)]) -> Vec<String> {
    results.iter().filter(|(_, o)| !o.starts_with("refused")).map(|(w, o)| format!("{w}: {o}")).collect()
}

/// The processes named `name` (by their `comm`).
fn named(name: &str) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim_end() == name))
        .collect()
}

fn unique(what: &str) -> String {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    // comm holds 15 bytes.
    format!("tw{}{}{}", &what[..2], std::process::id() % 100_000, N.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
}

fn userns_available() -> bool {
    worker::probe().user_namespaces
}

/// The suite against a sandboxed worker: nothing escapes. Returns the outcomes.
fn suite() -> Vec<(String, String)> {
    let t = Targets::new();
    let w = sandboxed().spawn().unwrap();
    assert_eq!(w.call("a", "pid", vec![]).unwrap(), Value::Int(1), "a sandboxed worker is pid 1 of its own namespace");
    let results = attack_all(&w, &t);
    // The architecture check kills a process making an i386 system call.
    let e = w.call("a", "int80", vec![]).unwrap_err();
    assert!(e.to_string().contains("SIGSYS"), "an int 0x80 system call must kill the worker (SIGSYS): {e}");
    results
}

#[test]
fn every_attack_from_a_sandboxed_worker_is_refused() {
    let _one = serial();
    if !userns_available() {
        panic!("this machine refuses user namespaces ({}): the escape suite needs them", worker::probe().user_namespaces_why);
    }
    let results = suite();
    for (what, o) in &results {
        eprintln!("{what:32} {o}");
    }
    assert!(escaped(&results).is_empty(), "escapes from a sandboxed worker: {:#?}", escaped(&results));
}

#[test]
fn the_same_attacks_from_an_unsandboxed_worker_succeed() {
    let _one = serial();
    let t = Targets::new();
    let w = spec().spawn().unwrap();
    let results = attack_all(&w, &t);
    let got = escaped(&results);
    // What each refusal above is the sandbox's: these succeed without it.
    for must in ["unix socket by path", "unix socket by abstract name", "tcp to the host", "SIGSTOP another process", "the host's environment", "an inherited fd", "a host file", "clone3"] {
        assert!(got.iter().any(|g| g.starts_with(must)), "{must} should succeed from an unsandboxed worker: {got:#?}");
    }
    assert!(w.call("a", "int80", vec![]).unwrap().as_str().unwrap().starts_with("escaped"));
}

/// A worker that started a grandchild in a session of its own, then ended `how`: the
/// grandchild must be gone when the supervisor's call or drop returns.
fn nothing_outlives(how: &str) {
    let name = unique(how);
    let mut w = Some(sandboxed().spawn().unwrap());
    let wk = w.as_ref().unwrap();
    assert_eq!(wk.call("a", "escapee", vec![name.clone().into()]).unwrap(), Value::Str("started".into()));
    let deadline = Instant::now() + Duration::from_secs(5);
    while named(&name).is_empty() {
        assert!(Instant::now() < deadline, "the escapee never started");
        std::thread::sleep(Duration::from_millis(5));
    }
    match how {
        "deadline" => {
            let e = wk.call_with("a", "sleep", vec![10.into()], Map::new(), Some(Duration::from_millis(300))).unwrap_err();
            assert!(matches!(e, RpcError::Timeout { .. }), "{e}");
        }
        "exit" => {
            let e = wk.call("a", "exit", vec![]).unwrap_err();
            assert!(e.is_peer_gone(), "{e}");
        }
        "kill" => wk.kill(),
        "drop" => drop(w.take()),
        _ => unreachable!(),
    }
    assert_eq!(named(&name), Vec::<u32>::new(), "a descendant of the worker outlived its end by {how}");
    drop(w);
}

#[test]
fn nothing_outlives_a_deadline_kill() {
    let _one = serial();
    nothing_outlives("deadline");
}

#[test]
fn nothing_outlives_a_clean_exit() {
    let _one = serial();
    nothing_outlives("exit");
}

#[test]
fn nothing_outlives_a_kill() {
    let _one = serial();
    nothing_outlives("kill");
}

#[test]
fn nothing_outlives_a_drop() {
    let _one = serial();
    nothing_outlives("drop");
}

/// A supervisor process (role `supervisor <mode>`): `escapee <name>` starts a sandboxed
/// worker that starts a named grandchild, says READY and waits to be killed; `suite` runs
/// the escape suite (the unprivileged run) and exits 0 only if nothing escaped.
#[test]
fn supervisor_entry() {
    let Some(mode) = role() else { return };
    let mode = mode.strip_prefix("supervisor ").unwrap_or_else(|| panic!("not a supervisor role: {mode:?}"));
    let _one = serial();
    if mode == "suite" {
        let results = suite();
        for (what, o) in &results {
            println!("{what:32} {o}");
        }
        let bad = escaped(&results);
        println!("ESCAPED {}", bad.len());
        std::process::exit(if bad.is_empty() { 0 } else { 1 });
    }
    let name = mode.strip_prefix("escapee ").unwrap().to_string();
    let w = sandboxed().spawn().unwrap();
    w.call("a", "escapee", vec![name.into()]).unwrap();
    println!("READY");
    std::io::stdout().flush().unwrap();
    std::mem::forget(w);
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}

fn supervisor(mode: &str) -> Command {
    RoleCommand::new(&format!("supervisor {mode}")).test("supervisor_entry").quiet().command()
}

#[test]
fn nothing_outlives_the_supervisors_death() {
    let _one = serial();
    let name = unique("sup");
    /// Killed however the test ends: a failed assertion must not leave it running.
    struct Killed(std::process::Child);
    impl Drop for Killed {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut sup = Killed(supervisor(&format!("escapee {name}")).stdout(Stdio::piped()).spawn().unwrap());
    let sup = &mut sup.0;
    // The test harness's own lines come first; the reader stays open (the worker writes
    // to the same pipe).
    let mut out = BufReader::new(sup.stdout.take().unwrap());
    let mut line = String::new();
    while line.trim() != "READY" {
        line.clear();
        assert!(out.read_line(&mut line).unwrap() > 0, "the supervisor ended before READY");
    }
    // The grandchild names itself after its parent answered: give it a moment.
    let by = Instant::now() + Duration::from_secs(5);
    while named(&name).is_empty() {
        assert!(Instant::now() < by, "the escapee never started");
        std::thread::sleep(Duration::from_millis(5));
    }
    sup.kill().unwrap();
    sup.wait().unwrap();
    drop(out);
    // The chain supervisor -> keeper -> pid 1 is the kernel's parent-death signals: not
    // synchronous with the supervisor's end, so wait a bounded moment.
    let by = Instant::now() + Duration::from_secs(5);
    while !named(&name).is_empty() {
        assert!(Instant::now() < by, "a descendant of the worker outlived its supervisor: {:?}", named(&name));
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn every_attack_is_refused_with_an_unprivileged_supervisor() {
    let _one = serial();
    // SAFETY: geteuid cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("this run is unprivileged already: every other test of this file is the unprivileged run");
        return;
    }
    let nobody = 65534;
    let out = supervisor("suite")
        .uid(nobody)
        .gid(nobody)
        .current_dir(std::env::temp_dir())
        .env("HOME", std::env::temp_dir())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    eprintln!("{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && text.contains("ESCAPED 0"), "the suite as uid {nobody} failed or found escapes: {}", out.status);
}

/// A keeper lives as long as its worker; it must not hold the supervisor's memory
/// (copy-on-write pages it kept would make every later write of the supervisor's a copy).
#[test]
fn a_keeper_does_not_hold_the_supervisors_memory() {
    let _one = serial();
    let mut big = vec![0u8; 256 << 20];
    big.iter_mut().step_by(4096).for_each(|b| *b = 1);
    let w = sandboxed().spawn().unwrap();
    let keeper = w.pid().unwrap();
    let status = std::fs::read_to_string(format!("/proc/{keeper}/status")).unwrap();
    let anon_kib: u64 = status.lines().find_map(|l| l.strip_prefix("RssAnon:")).unwrap().trim().trim_end_matches(" kB").trim().parse().unwrap();
    assert!(anon_kib < 64 << 10, "the keeper holds {anon_kib} KiB of anonymous memory while the supervisor has 256 MiB");
    assert_eq!(big[4096], 1);
}
