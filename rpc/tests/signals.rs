//! RPC calls under a storm of signals whose handlers are installed without SA_RESTART
//! (every blocking system call they interrupt fails with EINTR): calls complete, a call
//! that times out does so after its timeout and not before, and a server accepts and
//! answers a new connection — no EINTR leaks out as a failure.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tensorwire_rpc::*;

static SIGNALS: AtomicU64 = AtomicU64::new(0);

extern "C" fn count_signal(_: libc::c_int) {
    SIGNALS.fetch_add(1, Ordering::Relaxed);
}

/// Signal the threads `tids` (SIGUSR1 and SIGALRM in turn, handlers without
/// SA_RESTART) every 100 µs until `stop` is set. Only these threads get signals.
fn storm(tids: Vec<libc::pid_t>, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<()> {
    for sig in [libc::SIGUSR1, libc::SIGALRM] {
        // SAFETY: a zeroed sigaction is valid; the handler only touches an atomic
        // (async-signal-safe); no SA_RESTART, on purpose.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = count_signal as *const () as usize;
            libc::sigemptyset(&mut sa.sa_mask);
            assert_eq!(libc::sigaction(sig, &sa, std::ptr::null_mut()), 0);
        }
    }
    std::thread::spawn(move || {
        // SAFETY: getpid has no preconditions.
        let pid = unsafe { libc::getpid() };
        let mut n = 0usize;
        while !stop.load(Ordering::Relaxed) {
            let sig = if n % 2 == 0 { libc::SIGUSR1 } else { libc::SIGALRM };
            let tid = tids[n % tids.len()];
            // SAFETY: tgkill with our own pid and a tid of one of our live threads.
            unsafe { libc::syscall(libc::SYS_tgkill, pid, tid, sig) };
            n += 1;
            std::thread::sleep(Duration::from_micros(100));
        }
    })
}

fn service() -> Service {
    Service::new("Calc")
        .method_inline("add", |_, a| Ok(Value::Int(a.req(0, "a")?.as_i64().unwrap() + a.req(1, "b")?.as_i64().unwrap())))
        .method("sleep", |_, a| {
            std::thread::sleep(Duration::from_secs_f64(a.req(0, "s")?.as_f64().unwrap()));
            Ok(Value::from("slept"))
        })
}

#[test]
fn rpc_calls_survive_a_signal_storm() {
    let dir = std::env::temp_dir().join(format!("tw-rpc-signals-{}", std::process::id()));
    let _ = std::fs::remove_file(&dir);
    let addr = dir.display().to_string();
    let reg = Registry::new();
    reg.register("calc", service()).unwrap();
    let server = Arc::new(Server::bind(&addr, reg, RpcConfig::default()).unwrap());
    let (tid_tx, tid_rx) = std::sync::mpsc::channel();
    let s2 = server.clone();
    let serving = std::thread::spawn(move || {
        // SAFETY: gettid has no preconditions.
        tid_tx.send(unsafe { libc::gettid() }).unwrap();
        s2.serve_forever()
    });
    // SAFETY: gettid has no preconditions.
    let me = unsafe { libc::gettid() };
    let stop = Arc::new(AtomicBool::new(false));
    let storm = storm(vec![me, tid_rx.recv().unwrap()], stop.clone());
    std::thread::sleep(Duration::from_millis(20));

    // Connect and handshake with the storm on both the client and the accepting thread.
    let client = Endpoint::connect(&addr, Registry::new(), RpcConfig::default()).unwrap();
    for i in 0..300 {
        assert_eq!(client.call("calc", "add", vec![i.into(), 1.into()]).unwrap(), Value::Int(i + 1));
    }
    // A reply that takes 200 ms: the waiting client sleeps through many signals.
    assert_eq!(client.call("calc", "sleep", vec![0.2.into()]).unwrap(), Value::from("slept"));
    // A call that outlives its timeout times out after it, not at the first signal.
    let t0 = Instant::now();
    let e = client
        .call_with("calc", "sleep", vec![1.0.into()], Map::new(), CallOptions { timeout: Some(Wait::For(Duration::from_millis(300))), ..Default::default() })
        .unwrap_err();
    assert!(matches!(e, RpcError::Timeout { .. }), "{e}");
    assert!(t0.elapsed() >= Duration::from_millis(300), "a 300 ms call gave up after {:?}", t0.elapsed());
    // A second connection is accepted and served while the storm goes on.
    let second = Endpoint::connect(&addr, Registry::new(), RpcConfig::default()).unwrap();
    assert_eq!(second.call("calc", "add", vec![2.into(), 2.into()]).unwrap(), Value::Int(4));

    stop.store(true, Ordering::Relaxed);
    storm.join().unwrap();
    assert!(SIGNALS.load(Ordering::Relaxed) > 100, "only {} signals were delivered", SIGNALS.load(Ordering::Relaxed));
    client.close(Duration::from_secs(2));
    second.close(Duration::from_secs(2));
    // The server serves until the process exits (it has no shutdown); its thread is left.
    drop(serving);
}
