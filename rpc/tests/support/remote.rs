//! What the remote-tensor test binaries (`remote_ucx.rs`, `remote_pool.rs`; feature `ucx`)
//! share: the server each starts as a child (the test binary re-run in the role `server`,
//! through its own `child_role` test), the client's config, and small checks.

use std::io::Read;
use std::process::{Child, ChildStdin, Stdio};
use std::time::{Duration, Instant};
use tensorwire_rpc::*;
use tensorwire_test_support::{Lines, RoleCommand, pattern, say};

/// `got == want` for byte buffers, reported by the first difference (not the whole buffer).
pub fn same(got: &[u8], want: &[u8], what: &str) {
    if got != want {
        let i = got.iter().zip(want).position(|(a, b)| a != b).unwrap_or(got.len().min(want.len()));
        panic!("{what}: {} bytes vs {} expected, first difference at byte {i}", got.len(), want.len());
    }
}

fn int(a: &Args, i: usize) -> Result<i64> {
    a.req(i, "int")?.as_i64().ok_or_else(|| RpcError::InvalidArgument(format!("argument {i} is not an int")))
}

// ---------------------------------------------------------------- the server

/// The server: `t.make(seed, n)` (a uint8 tensor of `n` pattern bytes), `t.make_view(seed,
/// n)` (every other byte of it, from byte 1), `t.check(tensor, seed)` (whether its packed
/// bytes are the pattern), `t.live()` (remote exports unreleased over all its connections).
pub fn serve() -> ! {
    let remote = std::env::var("TW_REMOTE_ON").as_deref() == Ok("1");
    let env_u64 = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<u64>().ok());
    let mut cfg = RpcConfig { remote_tensors: remote, ..small_frames() };
    if let Some(b) = env_u64("TW_MSG_BUDGET") {
        cfg.max_remote_message_bytes = b;
    }
    if let Some(b) = env_u64("TW_CONN_BUDGET") {
        cfg.max_remote_connection_bytes = b;
    }
    if let Some(s) = env_u64("TW_IMPORT_TIMEOUT_S") {
        cfg.remote_import_timeout = Duration::from_secs(s);
    }
    let kept: std::sync::Arc<std::sync::Mutex<Vec<Value>>> = Default::default();
    let (k1, k2) = (kept.clone(), kept);
    let reg = Registry::new();
    reg.register(
        "t",
        Service::new("T")
            .method("make", |_, a| {
                let (seed, n) = (int(&a, 0)? as u8, int(&a, 1)? as usize);
                Ok(Value::from(Tensor::from_bytes(tensorwire::DType::UInt8, &[n as i64], &pattern(seed, n))?))
            })
            .method("make_view", |_, a| {
                let (seed, n) = (int(&a, 0)? as u8, int(&a, 1)? as usize);
                let Tensor::Shared(s) = Tensor::from_bytes(tensorwire::DType::UInt8, &[n as i64], &pattern(seed, n))? else {
                    unreachable!()
                };
                let l = tensorwire::Layout::strided(tensorwire::DType::UInt8, &[(n / 2) as i64], &[2], 1)?;
                Ok(Value::from(Tensor::Shared(s.view(l)?)))
            })
            .method("check", |_, a| {
                let t = a.req(0, "tensor")?.as_tensor().ok_or_else(|| RpcError::InvalidArgument("not a tensor".into()))?;
                Ok(Value::Bool(t.to_vec()? == pattern(int(&a, 1)? as u8, t.layout().numel() as usize)))
            })
            .method("live", |_, _| Ok(Value::from(Endpoint::process_remote_exports() as i64)))
            // Keeps its argument (a received tensor stays alive), or drops all kept.
            .method("keep", move |_, a| {
                k1.lock().unwrap().push(a.req(0, "tensor")?.clone());
                Ok(Value::Null)
            })
            .method("forget", move |_, _| {
                k2.lock().unwrap().clear();
                Ok(Value::Null)
            }),
    )
    .unwrap();
    let server = Server::bind("tcp://127.0.0.1:0", reg, cfg).unwrap();
    say(&server.local_addr().to_string());
    std::thread::spawn(move || server.serve_forever());
    // Until the parent closes our stdin (or dies).
    let _ = std::io::stdin().read_to_end(&mut Vec::new());
    std::process::exit(0);
}

/// A child of this test binary in a role, and the first line it printed.
pub struct Proc {
    pub child: Child,
    pub stdin: Option<ChildStdin>,
    pub line: String,
}

impl Proc {
    pub fn spawn(role: &str, env: &[(&str, &str)]) -> Proc {
        let child = RoleCommand::new(role)
            .test("child_role")
            .envs(env.iter().copied())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn();
        let mut io = Lines::new(child);
        let line = io.recv().unwrap_or_else(|| panic!("{role} ended before its first line"));
        // Only the first line is read: the rest of the child's stdout goes nowhere.
        let Lines { child, tx: stdin, .. } = io;
        Proc { child, stdin, line }
    }

    pub fn server(remote: bool) -> Proc {
        Proc::spawn("server", &[("TW_REMOTE_ON", if remote { "1" } else { "0" })])
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        drop(self.stdin.take());
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// ---------------------------------------------------------------- the client

/// Both sides take frames of 1 MiB at most: a tensor of several MiB that arrives went by
/// UCX, not inline.
pub fn small_frames() -> RpcConfig {
    RpcConfig { max_frame: 1 << 20, remote_import_timeout: Duration::from_secs(5), ..RpcConfig::default() }
}

pub fn client(addr: &str, remote: bool) -> Endpoint {
    let cfg = RpcConfig { remote_tensors: remote, ..small_frames() };
    Endpoint::connect(addr, Registry::new(), cfg).unwrap()
}

/// Polls `f` until it returns `want` (5 s at most); returns the last value.
pub fn eventually<T: PartialEq + Copy>(want: T, mut f: impl FnMut() -> T) -> T {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let v = f();
        if v == want || Instant::now() > deadline {
            return v;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
