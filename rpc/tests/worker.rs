//! Supervised workers across real processes: calls, output, per-call deadlines, crashes,
//! death with the supervisor, limits, the sandbox, the warm pool and a hostile worker.
//!
//! Every worker is this test binary run again as `worker_entry` in a child role
//! (`tensorwire_test_support::RoleCommand`; and a supervisor process, for the tests that
//! must kill or watch the supervisor, as `supervisor_entry` in the role `supervisor
//! <mode>`).

use std::io::{BufRead, BufReader, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use tensorwire_rpc::worker::{self, Captured};
use tensorwire_rpc::*;
use tensorwire_test_support::{RoleCommand, role, wait_until};

/// A worker of this binary in `role`. Every call has a deadline (tests that test
/// deadlines set shorter ones): a call that never returns fails its test instead of
/// hanging the run.
fn spec(role: &str) -> WorkerSpec {
    let child = RoleCommand::new(role).test("worker_entry").quiet();
    child
        .vars()
        .into_iter()
        .fold(WorkerSpec::new(RoleCommand::program()).args(child.argv()), |s, (k, v)| s.env(k, v))
        .handshake_timeout(Duration::from_secs(30))
        .call_timeout(Duration::from_secs(60))
}

fn int(v: &Value) -> i64 {
    v.as_i64().unwrap_or_else(|| panic!("not an int: {v:?}"))
}

fn alive(pid: u32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    unsafe { libc::kill(pid as libc::pid_t, 0) == 0 }
}

/// The supervisor-side tests one at a time: they count this process's fds, and each
/// starts processes of its own.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    ONE.lock().unwrap_or_else(|e| e.into_inner())
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

fn captured_stdout(c: &Captured) -> String {
    String::from_utf8_lossy(&c.stdout()).into_owned()
}

// ---- the worker's side -------------------------------------------------------------

/// The service every worker serves.
fn service() -> Service {
    Service::new("W")
        .method_inline("add", |_, a| Ok(Value::Int(int(a.req(0, "a")?) + int(a.req(1, "b")?))))
        .method("say", |_, a| {
            println!("{}", a.req(0, "text")?.as_str().unwrap_or(""));
            std::io::stdout().flush().unwrap();
            Ok(Value::Null)
        })
        .method("sleep", |_, a| {
            std::thread::sleep(Duration::from_secs_f64(a.req(0, "s")?.as_f64().unwrap()));
            Ok(Value::Null)
        })
        .method("die", |_, a| {
            match a.req(0, "how")?.as_str().unwrap() {
                "exit3" => std::process::exit(3),
                // A real fault (a raised SIGSEGV would only reach Rust's own handler,
                // which restores the default and returns).
                // SAFETY: none: this crashes the worker on purpose, as a bug would.
                "segv" => unsafe { std::ptr::null_mut::<i32>().write_volatile(1) },
                // SAFETY: raise ends this process with the signal; nothing to uphold.
                _ => drop(unsafe { libc::raise(libc::SIGKILL) }),
            };
            Ok(Value::Null)
        })
        .method("rlimits", |_, _| {
            let get = |r| {
                let mut l = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
                // SAFETY: `l` is writable.
                unsafe { libc::getrlimit(r, &mut l) };
                Value::Int(l.rlim_cur as i64)
            };
            Ok(Value::Array(vec![get(libc::RLIMIT_NOFILE), get(libc::RLIMIT_AS), get(libc::RLIMIT_CPU)]))
        })
        .method("read", |_, a| {
            let path = a.req(0, "path")?.as_str().unwrap().to_string();
            std::fs::read(&path).map(|b| Value::Int(b.len() as i64)).map_err(|e| RpcError::Remote(format!("read {path}: {e}")))
        })
        .method("write", |_, a| {
            let path = a.req(0, "path")?.as_str().unwrap().to_string();
            std::fs::write(&path, b"x").map(|_| Value::Null).map_err(|e| RpcError::Remote(format!("write {path}: {e}")))
        })
        .method("socket", |_, a| {
            let family = if a.req(0, "family")?.as_str() == Some("unix") { libc::AF_UNIX } else { libc::AF_INET };
            // SAFETY: plain syscall; the fd is closed right away.
            let fd = unsafe { libc::socket(family, libc::SOCK_STREAM, 0) };
            if fd < 0 {
                return Err(RpcError::Remote(format!("socket: {}", std::io::Error::last_os_error())));
            }
            // SAFETY: ours, just created.
            drop(unsafe { OwnedFd::from_raw_fd(fd) });
            Ok(Value::Null)
        })
        .method("exec", |_, _| {
            Command::new("/bin/true").status().map(|_| Value::Null).map_err(|e| RpcError::Remote(format!("exec: {e}")))
        })
        .method("sum", |_, a| {
            let t = a.req(0, "t")?.as_tensor().ok_or_else(|| RpcError::Remote("not a tensor".into()))?.clone();
            let native = matches!(t, Tensor::Imported(_));
            Ok(Value::Array(vec![Value::Float(t.to_f64_vec()?.iter().sum()), Value::Bool(native)]))
        })
}

/// Write raw bytes the RPC protocol does not allow on the worker's connection (a dup of
/// the fd the supervisor gave it), then wait to be killed.
fn hostile(conn: i32, kind: &str) -> ! {
    let frame: Vec<u8> = match kind {
        // A frame declaring 2^32 - 1 bytes.
        "length" => vec![0xff, 0xff, 0xff, 0xff],
        // A million nested arrays.
        "deep" => {
            let body = "[".repeat(1_000_000);
            let mut f = (body.len() as u32).to_be_bytes().to_vec();
            f.extend_from_slice(body.as_bytes());
            f
        }
        _ => {
            let body = b"\x00\x01garbage, not JSON";
            let mut f = (body.len() as u32).to_be_bytes().to_vec();
            f.extend_from_slice(body);
            f
        }
    };
    // SAFETY: writing a buffer we own to an fd we hold (dup'd at start-up).
    unsafe { libc::write(conn, frame.as_ptr().cast(), frame.len()) };
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}

#[test]
fn worker_entry() {
    let Some(role) = role() else { return };
    let reg = Registry::new();
    let mut svc = service();
    if let Some(kind) = role.strip_prefix("hostile-") {
        // SAFETY: dup of the fd the supervisor handed us (checked again by `serve`).
        let conn = unsafe { libc::dup(std::env::var(worker::FD_ENV).unwrap().parse().unwrap()) };
        let kind = kind.to_string();
        svc = svc.method("hostile", move |_, _| hostile(conn, &kind));
    }
    reg.register("w", svc).unwrap();
    if role == "no-hello" {
        std::thread::sleep(Duration::from_secs(60));
    }
    let r = worker::serve(reg, RpcConfig::default());
    std::process::exit(if r.is_ok() { 0 } else { 70 });
}

/// A supervisor process (role `supervisor <mode>`): `prefixed` starts a worker with
/// `Output::Prefixed("[w] ")` and has it say hello; `stuck` starts one that never reaches
/// `serve` (as a worker still importing would), so only the kernel's parent-death signal
/// can end it. Either prints the worker's pid, then waits to be killed.
#[test]
fn supervisor_entry() {
    let Some(mode) = role() else { return };
    let mode = mode.strip_prefix("supervisor ").unwrap_or_else(|| panic!("not a supervisor role: {mode:?}"));
    let pid = if mode == "prefixed" {
        let w = spec("plain").output(Output::Prefixed("[w] ".into())).spawn().unwrap();
        w.call("w", "say", vec!["hello from the worker".into()]).unwrap();
        let pid = w.pid().unwrap();
        std::mem::forget(w);
        pid
    } else {
        std::thread::spawn(|| spec("no-hello").handshake_timeout(Duration::from_secs(600)).spawn());
        loop {
            let children: Vec<u32> = std::fs::read_dir("/proc/self/task")
                .unwrap()
                .filter_map(|t| std::fs::read_to_string(t.unwrap().path().join("children")).ok())
                .flat_map(|c| c.split_whitespace().map(|p| p.parse().unwrap()).collect::<Vec<u32>>())
                .collect();
            if let Some(p) = children.first() {
                break *p;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    println!("WORKER {pid}");
    std::io::stdout().flush().unwrap();
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// A supervisor process, killed and reaped when dropped (also when a test fails), and by
/// the kernel if this test's thread ends first (`PR_SET_PDEATHSIG`): a supervisor left
/// running would keep this test binary's stdout open and hang whoever reads it to EOF.
struct Supervisor(std::process::Child);

impl Drop for Supervisor {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Start a supervisor in `mode`; its stdout lines before it named the worker, the lines
/// after as they come, and the worker's pid.
fn supervisor(mode: &str) -> (Supervisor, Vec<String>, std::sync::mpsc::Receiver<String>, u32) {
    use std::os::unix::process::CommandExt;
    let mut cmd =
        RoleCommand::new(&format!("supervisor {mode}")).test("supervisor_entry").quiet().stdout(Stdio::piped()).command();
    // SAFETY: prctl in the forked child before exec: async-signal-safe, no allocation.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut sup = Supervisor(cmd.spawn().unwrap());
    let (tx, lines) = std::sync::mpsc::channel();
    let out = sup.0.stdout.take().unwrap();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines() {
            let Ok(l) = l else { break };
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    let mut before = Vec::new();
    loop {
        let l = lines.recv_timeout(Duration::from_secs(60)).expect("the supervisor never named its worker");
        match l.split_once("WORKER ") {
            Some((_, p)) => return (sup, before, lines, p.trim().parse().unwrap()),
            None => before.push(l),
        }
    }
}

fn gone(pid: u32) -> bool {
    !alive(pid) || std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| s.contains(") Z "))
}

// ---- the supervisor's side ---------------------------------------------------------

#[test]
fn a_worker_answers_calls_and_its_output_is_captured() {
    let _one = serial();
    let w = spec("plain").output(Output::Capture { max_bytes: 1 << 16 }).spawn().unwrap();
    let pid = w.pid().unwrap();
    assert_ne!(pid, std::process::id());
    assert_eq!(w.call("w", "add", vec![1.into(), 2.into()]).unwrap(), Value::Int(3));
    w.call("w", "say", vec!["captured line".into()]).unwrap();
    let out = w.output().unwrap();
    wait_until("the captured line", Duration::from_secs(5), || captured_stdout(&out).contains("captured line"));
    // A handler's own error reaches the caller and leaves the worker as it was.
    let e = w.call("w", "read", vec!["/nonexistent/x".into()]).unwrap_err();
    assert!(matches!(&e, RpcError::Remote(m) if m.contains("No such file")), "{e}");
    assert!(w.is_clean() && w.pid() == Some(pid));
}

#[test]
fn output_is_forwarded_with_a_prefix() {
    let _one = serial();
    let (sup, mut seen, lines, worker) = supervisor("prefixed");
    // The worker's line reaches the supervisor's stdout through its forwarding thread,
    // before or after the supervisor names the worker.
    while !seen.iter().any(|l: &String| l.contains("[w] hello from the worker")) {
        match lines.recv_timeout(Duration::from_secs(10)) {
            Ok(l) => seen.push(l),
            Err(_) => panic!("no prefixed line in {seen:?}"),
        }
    }
    drop(sup);
    wait_until("the worker to end with its supervisor", Duration::from_secs(10), || gone(worker));
}

#[test]
fn a_worker_that_is_not_serving_yet_dies_with_its_supervisor() {
    let _one = serial();
    let (sup, _, _, worker) = supervisor("stuck");
    assert!(alive(worker));
    drop(sup);
    // Not connected to anything yet: only PR_SET_PDEATHSIG ends it (the reparented zombie
    // may linger until init reaps it).
    wait_until("the worker to die with its supervisor", Duration::from_secs(10), || gone(worker));
}

#[test]
fn a_call_past_its_deadline_kills_the_worker_and_the_next_call_gets_a_fresh_one() {
    let _one = serial();
    let w = spec("plain").call_timeout(Duration::from_millis(300)).spawn().unwrap();
    let first = w.pid().unwrap();
    let t = Instant::now();
    let e = w.call("w", "sleep", vec![30.into()]).unwrap_err();
    assert!(matches!(&e, RpcError::Timeout { what, .. } if what.contains("killed at its deadline")), "{e}");
    assert!(t.elapsed() < Duration::from_secs(10), "the deadline took {:?}", t.elapsed());
    assert!(!alive(first), "the worker still runs after its deadline");
    // Down, or already its replacement (started in the background at once).
    match w.state() {
        WorkerState::Down { why } => assert!(why.contains("passed its deadline"), "{why}"),
        WorkerState::Ready { pid } => assert_ne!(pid, first),
    }
    assert_eq!(w.call("w", "add", vec![2.into(), 2.into()]).unwrap(), Value::Int(4));
    let second = w.pid().unwrap();
    assert_ne!(first, second);
    // A deadline for one call only.
    let e = w.call_with("w", "sleep", vec![30.into()], Map::new(), Some(Duration::from_millis(100))).unwrap_err();
    assert!(matches!(e, RpcError::Timeout { .. }), "{e}");
    assert!(!alive(second));
}

#[test]
fn a_crashed_worker_fails_its_calls_with_how_it_ended_and_is_replaced() {
    let _one = serial();
    let w = spec("plain").spawn().unwrap();
    for (how, says) in [("kill", "was killed by SIGKILL"), ("segv", "was killed by SIGSEGV"), ("exit3", "exited with status 3")] {
        let pid = w.pid().unwrap_or_else(|| {
            w.call("w", "add", vec![0.into(), 0.into()]).unwrap();
            w.pid().unwrap()
        });
        let e = w.call("w", "die", vec![how.into()]).unwrap_err();
        assert!(matches!(&e, RpcError::PeerGone(m) if m.contains(&format!("worker {pid} {says}"))), "{how}: {e}");
        assert!(!alive(pid));
        assert!(w.pid() != Some(pid), "{:?}", w.state());
    }
    assert_eq!(w.call("w", "add", vec![1.into(), 1.into()]).unwrap(), Value::Int(2));
}

/// Counted in a process of its own (`fd_check_entry`): in this one, threads that earlier
/// tests left ending (output forwarders, readers) close their fds whenever they finish,
/// which moves the count under the test.
#[test]
fn workers_started_and_ended_leave_no_fds_behind() {
    let _one = serial();
    let mut child = Supervisor(
        RoleCommand::new("fd check")
            .test("fd_check_entry")
            .quiet()
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn(),
    );
    let stderr = child.0.stderr.take().unwrap();
    let said = std::thread::spawn(move || std::io::read_to_string(stderr).unwrap_or_default());
    let by = Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Some(s) = child.0.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < by, "the fd check did not end within 120 s");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "the fd check failed ({status}):\n{}", said.join().unwrap());
}

/// The fd check itself, run alone in a child process by the test above.
#[test]
fn fd_check_entry() {
    if role().is_none() {
        return;
    }
    drop(spec("plain").spawn().unwrap()); // the spawner thread and its fds, once
    // A dropped worker's reader and output threads close their ends as they finish, just
    // after the drop: count once the number has held still for half a second.
    let mut before = open_fds();
    let mut still_since = Instant::now();
    while still_since.elapsed() < Duration::from_millis(500) {
        std::thread::sleep(Duration::from_millis(10));
        let now = open_fds();
        if now != before {
            (before, still_since) = (now, Instant::now());
        }
    }
    for _ in 0..3 {
        let w = spec("plain").output(Output::Capture { max_bytes: 1024 }).call_timeout(Duration::from_millis(200)).spawn().unwrap();
        let _ = w.call("w", "sleep", vec![10.into()]);
        w.call("w", "add", vec![1.into(), 1.into()]).unwrap();
        let _ = w.call("w", "die", vec!["kill".into()]);
        drop(w);
    }
    let by = Instant::now() + Duration::from_secs(5);
    while open_fds() != before {
        assert!(Instant::now() < by, "{} fds open after three workers came and went, {before} before", open_fds());
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_worker_that_never_answers_its_handshake_is_killed() {
    let _one = serial();
    let t = Instant::now();
    let e = spec("no-hello").handshake_timeout(Duration::from_millis(500)).spawn().err().unwrap();
    assert!(matches!(&e, RpcError::Timeout { what, .. } if what.contains("handshake")), "{e}");
    assert!(t.elapsed() < Duration::from_secs(10));
    let e = WorkerSpec::new("/nonexistent/worker").spawn().err().unwrap();
    assert!(matches!(&e, RpcError::Io(m) if m.contains("/nonexistent/worker")), "{e}");
}

#[test]
fn limits_are_set_in_the_worker() {
    let _one = serial();
    let limits = Limits { open_files: Some(64), address_space: Some(16 << 30), cpu_seconds: Some(600) };
    let w = spec("plain").limits(limits).spawn().unwrap();
    let got = w.call("w", "rlimits", vec![]).unwrap();
    assert_eq!(got, Value::Array(vec![Value::Int(64), Value::Int(16 << 30), Value::Int(600)]));
}

fn landlock_available() -> bool {
    // SAFETY: landlock_create_ruleset(NULL, 0, VERSION) only reports the ABI version.
    unsafe { libc::syscall(libc::SYS_landlock_create_ruleset, std::ptr::null::<u8>(), 0usize, 1u32) > 0 }
}

#[test]
fn a_sandboxed_worker_is_denied_files_network_and_exec_and_tensors_still_flow() {
    let _one = serial();
    if !landlock_available() {
        eprintln!("SKIPPED: this kernel has no landlock");
        return;
    }
    let scratch = std::env::temp_dir().join(format!("tw-sandbox-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).unwrap();
    let sandbox = Sandbox { read: vec![], write: vec![scratch.clone()], ..Sandbox::default() };
    let w = spec("plain").sandbox(sandbox).spawn().unwrap();
    let hello = w.call(worker::CONTROL_ID, "hello", vec![]).unwrap();
    assert_eq!(hello.get("sandboxed"), Some(&Value::Bool(true)));
    let denied = |method: &str, args: Vec<Value>, says: &str| {
        let e = w.call("w", method, args).unwrap_err();
        assert!(matches!(&e, RpcError::Remote(m) if m.contains(says)), "{method}: {e}");
    };
    denied("read", vec!["/etc/hostname".into()], "Permission denied");
    denied("write", vec!["/tmp/tw-sandbox-escape".into()], "Permission denied");
    denied("socket", vec!["inet".into()], "Operation not permitted");
    denied("exec", vec![], "Operation not permitted");
    // A Unix socket it could open would reach any listening path or abstract name.
    denied("socket", vec!["unix".into()], "Operation not permitted");
    // What it may do: its scratch directory, and tensors (memfd, SCM_RIGHTS on its
    // connection, futex) natively.
    w.call("w", "write", vec![scratch.join("ok").display().to_string().into()]).unwrap();
    let t = Tensor::from_f32(&[4], &[1.0, 2.0, 3.0, 4.5]).unwrap();
    let got = w.call("w", "sum", vec![Value::from(t)]).unwrap();
    assert_eq!(got, Value::Array(vec![Value::Float(10.5), Value::Bool(true)]), "tensors must arrive natively in the sandbox");
    drop(w);
    std::fs::remove_dir_all(&scratch).unwrap();
    // The same calls unsandboxed succeed: the denials above are the sandbox's.
    let free = spec("plain").spawn().unwrap();
    free.call("w", "socket", vec!["inet".into()]).unwrap();
    free.call("w", "socket", vec!["unix".into()]).unwrap();
    free.call("w", "exec", vec![]).unwrap();
}

#[test]
fn a_pool_hands_out_warm_workers_and_takes_back_only_clean_ones() {
    let _one = serial();
    let pool = WorkerPool::new(spec("plain").call_timeout(Duration::from_millis(300)), 2).unwrap();
    assert_eq!(pool.idle(), 2);
    let first = {
        let w = pool.get().unwrap();
        assert_eq!(w.call("w", "add", vec![1.into(), 2.into()]).unwrap(), Value::Int(3));
        w.pid().unwrap()
    };
    assert!(pool.wait_idle(2, Duration::from_secs(30)));
    let w = pool.get().unwrap();
    assert_eq!(w.pid(), Some(first), "a cleanly finished worker is handed out again");
    assert!(w.call("w", "sleep", vec![10.into()]).is_err());
    drop(w);
    assert!(!alive(first));
    assert!(pool.wait_idle(2, Duration::from_secs(30)), "the hung worker was not replaced");
    let (a, b) = (pool.get().unwrap(), pool.get().unwrap());
    let pids = [a.pid().unwrap(), b.pid().unwrap()];
    assert!(!pids.contains(&first));
    // A third, with both handed out: none is started beyond the size; `get` waits.
    let t = Instant::now();
    let e = pool.get_timeout(Some(Duration::from_millis(200))).err().expect("a third worker from a pool of 2");
    assert!(matches!(&e, RpcError::Timeout { what, .. } if what.contains("pool of 2")), "{e}");
    assert!(t.elapsed() >= Duration::from_millis(200));
    // One comes back while a `get` waits: that `get` takes it, warm.
    let back = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(200));
        drop(a);
    });
    let c = pool.get_timeout(Some(Duration::from_secs(30))).unwrap();
    assert_eq!(c.pid(), Some(pids[0]));
    back.join().unwrap();
    drop((b, c));
    assert!(pool.wait_idle(2, Duration::from_secs(30)));
    assert_eq!(pool.idle(), 2, "the pool keeps at most its size");
}

#[test]
fn a_killed_workers_replacement_starts_in_the_background_and_a_cancel_applies_its_policy() {
    let _one = serial();
    let w = spec("plain").call_timeout(Duration::from_millis(300)).spawn().unwrap();
    let first = w.pid().unwrap();
    assert!(w.call("w", "sleep", vec![10.into()]).is_err());
    // No call made since: the replacement starts on its own.
    wait_until("the replacement to start", Duration::from_secs(30), || w.pid().is_some_and(|p| p != first));
    let second = w.pid().unwrap();
    assert!(alive(second));

    // Abandoned: the call is dropped, the process keeps running (and is not clean).
    let mut call = w.start_call("w", "sleep", vec![1.into()], Map::new(), Some(Duration::from_secs(30))).unwrap();
    assert!(w.wait_call(&mut call, Duration::from_millis(20)).is_none(), "still out");
    w.cancel_call(call, OnInterrupt::Abandon);
    assert_eq!(w.pid(), Some(second));
    assert!(!w.is_clean(), "a worker with an abandoned call is not clean");

    // Killed: the process goes, its replacement starts in the background.
    let mut call = w.start_call("w", "sleep", vec![10.into()], Map::new(), Some(Duration::from_secs(30))).unwrap();
    assert!(w.wait_call(&mut call, Duration::from_millis(20)).is_none());
    w.cancel_call(call, OnInterrupt::Kill);
    // Signalled at once, reaped off the caller's thread.
    wait_until("the killed worker to be reaped", Duration::from_secs(10), || !alive(second));
    wait_until("the replacement to start", Duration::from_secs(30), || w.pid().is_some_and(|p| p != second));
    assert_eq!(w.call("w", "add", vec![1.into(), 1.into()]).unwrap(), Value::Int(2));

    // A slice that ends before the deadline leaves the call out; the deadline kills.
    let third = w.pid().unwrap();
    let mut call = w.start_call("w", "sleep", vec![10.into()], Map::new(), Some(Duration::from_millis(200))).unwrap();
    let t = Instant::now();
    let r = loop {
        if let Some(r) = w.wait_call(&mut call, Duration::from_millis(20)) {
            break r;
        }
    };
    assert!(matches!(r, Err(RpcError::Timeout { .. })), "{r:?}");
    assert!(t.elapsed() >= Duration::from_millis(150) && !alive(third));
}

#[test]
fn a_hostile_worker_is_a_typed_error_and_the_supervisor_serves_its_other_workers() {
    let _one = serial();
    let other = spec("plain").spawn().unwrap();
    for kind in ["length", "deep", "garbage"] {
        let w = spec(&format!("hostile-{kind}")).spawn().unwrap();
        let pid = w.pid().unwrap();
        let e = w.call("w", "hostile", vec![]).unwrap_err();
        assert!(
            matches!(e, RpcError::FrameTooLarge { .. } | RpcError::DecodeLimit { .. } | RpcError::Protocol(_) | RpcError::Decode(_)),
            "{kind}: {e:?}"
        );
        assert!(!alive(pid), "{kind}: the hostile worker still runs");
        assert_eq!(other.call("w", "add", vec![20.into(), 22.into()]).unwrap(), Value::Int(42), "{kind}");
    }
}

