//! Calls beside busy threads, as many as CPUs: a wait that yields the CPU to a busy task
//! (instead of spinning on its own turn or sleeping) gets it back only at a scheduler tick,
//! and every call then takes milliseconds. See `endpoint::spin`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use tensorwire_rpc::{Endpoint, Registry, RpcConfig, Service, Value};

#[test]
fn calls_beside_busy_threads_do_not_wait_for_scheduler_ticks() {
    let s = Registry::new();
    s.register("svc", Service::new("Svc").method("noop", |_, _| Ok(Value::Null))).unwrap();
    let (_server, client) = Endpoint::pair(s, Registry::new(), RpcConfig::default()).unwrap();
    for _ in 0..200 {
        client.call("svc", "noop", vec![]).unwrap();
    }
    let stop = Arc::new(AtomicBool::new(false));
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let busy: Vec<_> = (0..cpus)
        .map(|_| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                // Relaxed: a stop flag; nothing else is read through it.
                while !stop.load(Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(50));
    let mut times = Vec::new();
    for _ in 0..300 {
        let t0 = Instant::now();
        client.call("svc", "noop", vec![]).unwrap();
        times.push(t0.elapsed());
    }
    // Relaxed: as above.
    stop.store(true, Ordering::Relaxed);
    for t in busy {
        t.join().unwrap();
    }
    times.sort();
    let p50 = times[times.len() / 2];
    // A scheduler tick is 1-10 ms; a call that does not wait for one takes tens of µs
    // (hundreds on a loaded machine).
    assert!(p50 < Duration::from_millis(1), "noop beside {cpus} busy threads: p50 {p50:?} (p90 {:?})", times[times.len() * 9 / 10]);
}
