//! A victim server in a child process, for hostile-peer tests that must watch a server's
//! resources (fds, threads, peak RSS) or put it under a resource limit (setrlimit) without
//! touching the test process itself.
//!
//! The test binary re-runs itself: `spawn` starts it as the role `<test>` running only
//! `<test>` (`tensorwire_test_support::RoleCommand`); the test function calls
//! [`victim_role`] first and, in the child, [`run_victim`] takes over (it never returns). The victim serves a small registry
//! on a Unix socket path with only the public API, prints `READY`, and exits when its
//! stdin closes (the parent died or finished) or after a hard deadline.

#![allow(dead_code)] // each test binary uses part of this

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::process::{Child, ChildStdin, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};
use tensorwire_rpc::*;
use tensorwire_test_support::RoleCommand;
/// No victim outlives this, whatever the parent does.
const VICTIM_DEADLINE: Duration = Duration::from_secs(120);

/// Resource limits and config knobs for the child, as environment variables.
#[derive(Default, Clone)]
pub struct VictimSpec {
    /// RLIMIT_NOFILE (soft and hard).
    pub nofile: Option<u64>,
    /// RLIMIT_AS in bytes.
    pub address_space: Option<u64>,
    /// Extra `KEY=VALUE` pairs the victim reads (config overrides).
    pub env: Vec<(String, String)>,
}

/// `Some(role)` in the child.
pub fn victim_role() -> Option<String> {
    tensorwire_test_support::role()
}

pub struct Victim {
    pub child: Child,
    pub addr: String,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
    stderr: std::sync::Arc<std::sync::Mutex<String>>,
}

static SOCK_SEQ: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

impl Victim {
    /// Start the victim for `test` (the name of the calling test function).
    pub fn spawn(test: &str, spec: &VictimSpec) -> Victim {
        let addr = format!(
            "/tmp/tw-hostile-{}-{}.sock",
            std::process::id(),
            SOCK_SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        let _ = std::fs::remove_file(&addr);
        let mut cmd = RoleCommand::new(test)
            .test(test)
            .env("TW_VICTIM_ADDR", &addr)
            // Fewer glibc malloc arenas: each reserves 64 MiB of address space, which
            // matters under RLIMIT_AS.
            .env("MALLOC_ARENA_MAX", "2")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some(n) = spec.nofile {
            cmd = cmd.env("TW_VICTIM_NOFILE", n.to_string());
        }
        if let Some(n) = spec.address_space {
            cmd = cmd.env("TW_VICTIM_AS", n.to_string());
        }
        let mut child = cmd.envs(spec.env.iter().map(|(k, v)| (k, v))).spawn();
        let (tx, lines) = mpsc::channel();
        let out = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines() {
                let Ok(l) = l else { break };
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        let stderr = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let (err, sink) = (child.stderr.take().unwrap(), stderr.clone());
        std::thread::spawn(move || {
            let mut r = BufReader::new(err);
            let mut buf = [0u8; 4096];
            while let Ok(n) = r.read(&mut buf) {
                if n == 0 {
                    break;
                }
                sink.lock().unwrap().push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        });
        let stdin = child.stdin.take();
        let mut v = Victim { child, addr, stdin, lines, stderr };
        v.expect_line("READY", Duration::from_secs(30));
        v
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Wait for a stdout line holding `prefix` (libtest may have written its own text
    /// before it on the same line); panics (with the victim's stderr) if it does not come.
    pub fn expect_line(&mut self, prefix: &str, within: Duration) -> String {
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) if l.contains(prefix) => return l,
                Ok(_) => {}
                Err(_) => panic!("victim never printed {prefix:?}; alive: {}; stderr:\n{}", self.alive(), self.stderr()),
            }
        }
    }

    /// Lines the victim printed so far (non-blocking).
    pub fn drain_lines(&self) -> Vec<String> {
        self.lines.try_iter().collect()
    }

    pub fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    /// Still running? (Reaps it if not.)
    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// How the victim ended, if it has (waits up to `within`).
    pub fn exit_status(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + within;
        loop {
            if let Ok(Some(s)) = self.child.try_wait() {
                return Some(s);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// A description for assertion messages.
    pub fn report(&mut self) -> String {
        let status = self.exit_status(Duration::from_millis(200));
        format!("victim status {status:?}; stdout {:?}; stderr:\n{}", self.drain_lines(), self.stderr())
    }

    pub fn fds(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.pid())).map(|d| d.count()).unwrap_or(0)
    }

    pub fn threads(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/task", self.pid())).map(|d| d.count()).unwrap_or(0)
    }

    /// A `/proc/<pid>/status` field in kB (VmHWM: peak RSS, VmRSS: RSS now).
    pub fn status_kb(&self, field: &str) -> u64 {
        let s = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap_or_default();
        s.lines()
            .find(|l| l.starts_with(field))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    }

    /// Wait until `f()` is stable for 200 ms (or `within` passes); returns its last value.
    pub fn settle(&self, within: Duration, f: impl Fn(&Victim) -> usize) -> usize {
        let deadline = Instant::now() + within;
        let mut last = f(self);
        let mut since = Instant::now();
        while Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(25));
            let now = f(self);
            if now != last {
                last = now;
                since = Instant::now();
            } else if since.elapsed() >= Duration::from_millis(200) {
                break;
            }
        }
        last
    }

    /// A raw connection to the victim.
    pub fn raw(&self) -> UnixStream {
        let s = UnixStream::connect(&self.addr).expect("connecting to the victim");
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s
    }

    /// A well-behaved client's call through the public API.
    pub fn call(&self, method: &str, args: Vec<Value>) -> Result<Value> {
        let cfg = RpcConfig { default_timeout: Wait::For(Duration::from_secs(10)), ..RpcConfig::default() };
        let ep = Endpoint::connect(&self.addr, Registry::new(), cfg)?;
        let r = ep.call("calc", method, args);
        ep.close(Duration::from_secs(1));
        r
    }
}

impl Drop for Victim {
    fn drop(&mut self) {
        drop(self.stdin.take());
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.addr);
    }
}

pub fn frame(payload: &[u8]) -> Vec<u8> {
    let mut v = (payload.len() as u32).to_be_bytes().to_vec();
    v.extend_from_slice(payload);
    v
}

/// Read one frame's payload (blocking up to the socket's read timeout).
pub fn read_frame(s: &mut UnixStream) -> std::io::Result<Vec<u8>> {
    let mut hdr = [0u8; 4];
    s.read_exact(&mut hdr)?;
    let mut body = vec![0u8; u32::from_be_bytes(hdr) as usize];
    s.read_exact(&mut body)?;
    Ok(body)
}

/// The JSON text of a call of `calc.method` with `args_json`, no kwargs.
pub fn call_text(call_id: i64, method: &str, args_json: &str) -> String {
    format!(
        r#"{{"kind": "call", "object_id": "calc", "call_id": {call_id}, "parent_call_id": null, "method": "{method}", "args": {args_json}, "kwargs": {{}}}}"#
    )
}

pub fn call_frame(call_id: i64, method: &str, args_json: &str) -> Vec<u8> {
    frame(call_text(call_id, method, args_json).as_bytes())
}

/// Raise this process's soft fd limit towards `want` (the hard limit caps it); returns
/// the soft limit now.
pub fn raise_own_nofile(want: u64) -> u64 {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: plain syscall writing into a local struct.
    unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) };
    if r.rlim_cur < want {
        let new = libc::rlimit { rlim_cur: want.min(r.rlim_max), rlim_max: r.rlim_max };
        // SAFETY: plain syscall reading a local struct.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &new) } == 0 {
            r.rlim_cur = new.rlim_cur;
        }
    }
    r.rlim_cur
}

fn env_u64(k: &str) -> Option<u64> {
    std::env::var(k).ok().and_then(|v| v.parse().ok())
}

fn set_limit(res: libc::__rlimit_resource_t, n: u64) {
    let r = libc::rlimit { rlim_cur: n, rlim_max: n };
    // SAFETY: plain syscall reading a local struct.
    let rc = unsafe { libc::setrlimit(res, &r) };
    assert_eq!(rc, 0, "setrlimit({res}, {n}): {}", std::io::Error::last_os_error());
}

/// The victim's registry: `echo` returns its arguments, `sum` adds a tensor's elements
/// (as the echo example does), `ping` answers `"pong"`, `cuda_nbytes` answers the storage
/// size of a CUDA tensor argument.
pub fn victim_registry() -> Registry {
    let reg = Registry::new();
    reg.register(
        "calc",
        Service::new("Calc")
            .method_inline("echo", |_, a| Ok(Value::Array(a.args)))
            .method_inline("ping", |_, _| Ok(Value::from("pong")))
            .method("sum", |_, a| {
                let t = a.req(0, "t")?.as_tensor().ok_or_else(|| RpcError::Remote("expected a tensor".into()))?;
                Ok(Value::Float(t.to_f64_vec()?.iter().sum()))
            })
            .method("cuda_nbytes", |_, a| match a.req(0, "t")?.as_tensor() {
                Some(Tensor::CudaImported(t)) => Ok(Value::Int(t.storage_nbytes() as i64)),
                other => Err(RpcError::Remote(format!("expected a CUDA tensor, got {other:?}"))),
            }),
    )
    .unwrap();
    reg
}

/// The child's whole life: limits, server, `READY`, serve until killed.
pub fn run_victim(configure: impl FnOnce(&mut RpcConfig)) -> ! {
    if let Some(n) = env_u64("TW_VICTIM_NOFILE") {
        set_limit(libc::RLIMIT_NOFILE, n);
    }
    if let Some(n) = env_u64("TW_VICTIM_AS") {
        set_limit(libc::RLIMIT_AS, n);
    }
    // Never outlive the parent: its end of our stdin closes when it exits.
    std::thread::spawn(|| {
        let mut b = [0u8; 64];
        while matches!(std::io::stdin().read(&mut b), Ok(n) if n > 0) {}
        std::process::exit(0);
    });
    std::thread::spawn(|| {
        std::thread::sleep(VICTIM_DEADLINE);
        eprintln!("victim: deadline passed");
        std::process::exit(9);
    });
    let addr = std::env::var("TW_VICTIM_ADDR").unwrap();
    let mut cfg = RpcConfig::default();
    configure(&mut cfg);
    let server = Server::bind(&addr, victim_registry(), cfg).expect("victim bind");
    println!("READY {}", std::process::id());
    std::io::stdout().flush().unwrap();
    let r = server.serve_forever();
    println!("SERVE_FOREVER RETURNED {r:?}");
    std::io::stdout().flush().unwrap();
    std::process::exit(3);
}
