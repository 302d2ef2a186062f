//! Endpoint behaviour between two Rust endpoints: calls, kwargs, errors, callbacks, nested
//! calls both ways (pool and inline handlers), many outstanding calls both ways, timeouts,
//! cancellation, async handlers, typed proxies, peer death, tensors.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use tensorwire_rpc::*;

fn calc() -> Service {
    Service::new("Calc")
        .method_inline("add", |_, a| Ok(Value::Int(a.req(0, "a")?.as_i64().unwrap() + a.req(1, "b")?.as_i64().unwrap())))
        .method("echo_kw", |_, a| Ok(Value::Object(a.kwargs)))
        .method("sleep", |_, a| {
            std::thread::sleep(Duration::from_secs_f64(a.req(0, "s")?.as_f64().unwrap()));
            Ok(Value::from("slept"))
        })
        .method("fail", |_, a| Err(RpcError::Remote(a.req(0, "msg")?.as_str().unwrap().to_owned())))
        .method("call_back", |ctx, mut a| {
            let cb = a.args.remove(0);
            ctx.invoke(&cb, a.args, a.kwargs)
        })
        .method_inline("call_back_inline", |ctx, mut a| {
            let cb = a.args.remove(0);
            ctx.invoke(&cb, a.args, a.kwargs)
        })
        .method("parent_of_nested", |ctx, _| {
            // Ask the peer which parent_call_id our nested request carried.
            let seen = ctx.call("peer", "whoami", vec![], Map::new())?;
            Ok(Value::Array(vec![Value::Int(ctx.call_id), seen]))
        })
        .method("describe", |_, a| {
            let t = a.req(0, "t")?.as_tensor().ok_or_else(|| RpcError::Remote("not a tensor".into()))?.clone();
            let sum: f64 = t.to_f64_vec()?.iter().sum();
            Ok(Value::Array(vec![Value::Str(t.dtype().name().into()), Value::Float(sum)]))
        })
        .method("echo", |_, mut a| Ok(a.args.swap_remove(0)))
        .method("echo_tail", |_, a| {
            // A view of the received storage other than the one sent: its last two elements.
            let Some(Tensor::Imported(imp)) = a.req(0, "t")?.as_tensor().cloned() else {
                return Err(RpcError::Remote("not a native tensor".into()));
            };
            let l = imp.layout();
            let tail = tensorwire::Layout::strided(l.dtype, &[2], &[1], l.numel() as i64 - 2)?;
            Ok(Value::from(Tensor::imported_view(imp, tail)?))
        })
        .method("make_tensor", |_, _| Ok(Value::from(Tensor::from_f32(&[2, 3], &[1., 2., 3., 4., 5., 6.])?)))
        .method_async("later", |_, a, resp| {
            let v = a.args.first().cloned().unwrap_or(Value::Null);
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(20));
                resp.respond(Ok(v));
            });
        })
        .method_async("forget", |_, _, resp| drop(resp))
        .method("count", |_, a| {
            let n = a.req(0, "items")?.as_array().map_or(0, |v| v.iter().filter(|x| x.as_tensor().is_some()).count());
            Ok(Value::Int(n as i64))
        })
}

fn peer_service() -> Service {
    Service::new("Peer").method("whoami", |ctx, _| Ok(ctx.parent_call_id.map_or(Value::Null, Value::Int)))
}

fn pair() -> (Endpoint, Endpoint) {
    let s = Registry::new();
    s.register("calc", calc()).unwrap();
    let c = Registry::new();
    c.register("peer", peer_service()).unwrap();
    Endpoint::pair(s, c, RpcConfig::default()).unwrap()
}

#[test]
fn call_kwargs_errors_and_lookup_failures() {
    let (_s, c) = pair();
    assert_eq!(c.call("calc", "add", vec![1.into(), 2.into()]).unwrap(), Value::Int(3));
    let mut kw = Map::new();
    kw.insert("x".into(), tagged::bytes(b"\x00\x01"));
    kw.insert("nested".into(), Value::parse(br#"{"a": [1, {"b": NaN}], "c": null}"#).unwrap());
    let r = c.call_with("calc", "echo_kw", vec![], kw.clone(), CallOptions::default()).unwrap();
    assert_eq!(tagged::as_bytes(r.get("x").unwrap()).unwrap(), b"\x00\x01");
    assert!(r.get("nested").unwrap().get("a").unwrap().as_array().unwrap()[1].get("b").unwrap().as_f64().unwrap().is_nan());
    match c.call("calc", "fail", vec!["boom".into()]) {
        Err(RpcError::Remote(m)) => assert_eq!(m, "boom"),
        other => panic!("{other:?}"),
    }
    let e = c.call("nope", "x", vec![]).unwrap_err().to_string();
    assert!(e.contains("Object ID nope not registered"), "{e}");
    let e = c.call("calc", "nope", vec![]).unwrap_err().to_string();
    assert!(e.contains("'Calc' object has no attribute 'nope'"), "{e}");
    assert!(!c.is_closed(), "application errors do not close the connection");
}

#[test]
fn callbacks_and_nested_calls_both_ways() {
    let (_s, c) = pair();
    let hits = Arc::new(AtomicUsize::new(0));
    let h = hits.clone();
    let cb = c
        .register_callback("mul", move |_, a| {
            h.fetch_add(1, Ordering::SeqCst);
            Ok(Value::Int(a.args[0].as_i64().unwrap() * a.args[1].as_i64().unwrap()))
        })
        .unwrap();
    for m in ["call_back", "call_back_inline"] {
        assert_eq!(c.call("calc", m, vec![cb.clone(), 6.into(), 7.into()]).unwrap(), Value::Int(42), "{m}");
    }
    assert_eq!(hits.load(Ordering::SeqCst), 2);
    // parent_call_id of the nested request names the request being handled.
    let r = c.call("calc", "parent_of_nested", vec![]).unwrap();
    let a = r.as_array().unwrap();
    assert_eq!(a[0], a[1], "nested call carried parent_call_id = the outer call's id: {r:?}");
    // Deep ping-pong: a callback that calls back into the server, which calls back...
    let c2 = c.clone();
    let depth = c
        .register_callback("recurse", move |ctx, a| {
            let n = a.args[0].as_i64().unwrap();
            if n == 0 {
                return Ok(Value::Int(0));
            }
            let me = a.args[1].clone();
            let r = ctx.call("calc", "call_back", vec![me.clone(), Value::Int(n - 1), me], Map::new())?;
            let _ = &c2;
            Ok(Value::Int(r.as_i64().unwrap() + 1))
        })
        .unwrap();
    assert_eq!(c.call("calc", "call_back", vec![depth.clone(), 10.into(), depth]).unwrap(), Value::Int(10));
    assert!(c.unregister_callback(&cb));
    let e = c.call("calc", "call_back", vec![cb, 1.into(), 1.into()]).unwrap_err().to_string();
    assert!(e.contains("not found"), "{e}");
}

#[test]
fn many_outstanding_calls_both_directions() {
    let (s, c) = pair();
    let mut threads = Vec::new();
    for t in 0..8i64 {
        let c = c.clone();
        let s = s.clone();
        threads.push(std::thread::spawn(move || {
            for i in 0..200i64 {
                assert_eq!(c.call("calc", "add", vec![t.into(), i.into()]).unwrap(), Value::Int(t + i));
                if i % 10 == 0 {
                    assert_eq!(s.call("peer", "whoami", vec![]).unwrap(), Value::Null);
                }
            }
        }));
    }
    // And many in flight at once from one thread.
    let pend: Vec<_> = (0..100i64).map(|i| c.start_call("calc", "add", vec![i.into(), 1.into()], Map::new(), CallOptions::default()).unwrap()).collect();
    let ids: std::collections::HashSet<i64> = pend.iter().map(|p| p.call_id()).collect();
    assert_eq!(ids.len(), 100);
    for (i, p) in pend.into_iter().enumerate() {
        assert_eq!(p.wait().unwrap(), Value::Int(i as i64 + 1));
    }
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(c.pending_calls(), 0);
}

#[test]
fn a_burst_to_an_inline_handler_is_never_answered_busy() {
    // Inline handlers need no worker thread. While a call of the serving side waits for
    // its response (and so reads the socket itself), the requests it reads must not be
    // charged to the worker pool: a burst of them beyond max_workers was answered "server
    // busy" (why many_outstanding_calls_both_directions failed now and then).
    let s_reg = Registry::new();
    s_reg.register("calc", calc()).unwrap();
    let c_reg = Registry::new();
    c_reg.register("peer", Service::new("Peer").method("slow", |_, _| {
        std::thread::sleep(Duration::from_millis(300));
        Ok(Value::Null)
    })).unwrap();
    let cfg = RpcConfig { max_workers: 2, ..RpcConfig::default() };
    let (s, c) = Endpoint::pair(s_reg, c_reg, cfg).unwrap();
    // The server's call leads its side of the socket for about 300 ms ...
    let s2 = s.clone();
    let leading = std::thread::spawn(move || s2.call("peer", "slow", vec![]));
    std::thread::sleep(Duration::from_millis(50));
    // ... while 50 requests to the server's inline `add` arrive at once.
    let pend: Vec<_> = (0..50i64).map(|i| c.start_call("calc", "add", vec![i.into(), 1.into()], Map::new(), CallOptions::default()).unwrap()).collect();
    for (i, p) in pend.into_iter().enumerate() {
        assert_eq!(p.wait().unwrap(), Value::Int(i as i64 + 1), "request {i}");
    }
    assert_eq!(leading.join().unwrap().unwrap(), Value::Null);
}

#[test]
fn inline_handlers_that_call_back_through_the_lane_do_not_deadlock() {
    // The server has one worker, and one of its calls leads its socket: what arrives for
    // its inline handlers waits in the lane. Each `outer` calls the client, whose `inner`
    // calls the server's inline `add` — which then waits in the lane behind the `outer`
    // whose nested call it answers. The lane thread must run it while it waits.
    let s_reg = Registry::new();
    s_reg
        .register(
            "calc",
            calc().method_inline("outer", |ctx, a| {
                let x = a.req(0, "x")?.clone();
                ctx.call("peer", "inner", vec![x], Map::new())
            }),
        )
        .unwrap();
    let c_reg = Registry::new();
    c_reg
        .register(
            "peer",
            Service::new("Peer")
                .method("inner", |ctx, a| ctx.call("calc", "add", vec![a.req(0, "x")?.clone(), 100.into()], Map::new()))
                .method("slow", |_, _| {
                    std::thread::sleep(Duration::from_millis(300));
                    Ok(Value::Null)
                }),
        )
        .unwrap();
    let (a, b) = Stream::pair().unwrap();
    let s = Endpoint::new(a, s_reg, RpcConfig { max_workers: 1, ..RpcConfig::default() }).unwrap();
    let c = Endpoint::new(b, c_reg, RpcConfig::default()).unwrap();
    let s2 = s.clone();
    let leading = std::thread::spawn(move || s2.call("peer", "slow", vec![]));
    std::thread::sleep(Duration::from_millis(50));
    let opts = CallOptions { timeout: Some(Wait::For(Duration::from_secs(10))), ..Default::default() };
    let pend: Vec<_> = (0..6i64).map(|i| c.start_call("calc", "outer", vec![i.into()], Map::new(), opts.clone()).unwrap()).collect();
    for (i, p) in pend.into_iter().enumerate() {
        assert_eq!(p.wait().unwrap(), Value::Int(i as i64 + 100), "outer {i}");
    }
    assert_eq!(leading.join().unwrap().unwrap(), Value::Null);
}

#[test]
fn timeouts_cancellation_and_late_responses() {
    let (_s, c) = pair();
    let t0 = Instant::now();
    let r = c.call_with("calc", "sleep", vec![0.3.into()], Map::new(), CallOptions { timeout: Some(Wait::For(Duration::from_millis(50))), ..Default::default() });
    assert!(matches!(r, Err(RpcError::Timeout { .. })), "{r:?}");
    assert!(t0.elapsed() < Duration::from_millis(250));
    let p = c.start_call("calc", "sleep", vec![0.2.into()], Map::new(), CallOptions::default()).unwrap();
    let canc = p.canceller();
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(30));
        canc.cancel();
    });
    assert!(matches!(p.wait(), Err(RpcError::Cancelled)));
    std::thread::sleep(Duration::from_millis(400));
    assert_eq!(c.stats().late_responses, 2, "both late responses were dropped and counted");
    assert_eq!(c.call("calc", "add", vec![1.into(), 1.into()]).unwrap(), Value::Int(2), "connection still fine");
}

#[test]
fn calls_wait_as_a_tensorwire_wait_says() {
    let (_s, c) = pair();
    // Never: the response if it is in, else Timeout at once.
    let p = c.start_call("calc", "sleep", vec![0.2.into()], Map::new(), CallOptions::default()).unwrap();
    let t0 = Instant::now();
    let r = p.wait_timeout(Wait::Never);
    assert!(matches!(r, Err(RpcError::Timeout { after: Duration::ZERO, .. })), "{r:?}");
    assert!(t0.elapsed() < Duration::from_millis(100), "Never must not block: {:?}", t0.elapsed());
    let p = c.start_call("calc", "add", vec![1.into(), 1.into()], Map::new(), CallOptions::default()).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while !p.is_done() {
        assert!(Instant::now() < deadline, "the response should come in");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(p.wait_timeout(Wait::Never).unwrap(), Value::Int(2), "Never takes a response that is in");
    // Until an instant.
    let p = c.start_call("calc", "sleep", vec![0.3.into()], Map::new(), CallOptions::default()).unwrap();
    let t0 = Instant::now();
    let r = p.wait_timeout(t0 + Duration::from_millis(50));
    assert!(matches!(r, Err(RpcError::Timeout { .. })), "{r:?}");
    assert!(t0.elapsed() >= Duration::from_millis(50) && t0.elapsed() < Duration::from_millis(250), "{:?}", t0.elapsed());
    // A Duration and an Option<Duration> convert.
    for w in [Wait::from(Duration::from_secs(5)), Wait::from(None::<Duration>)] {
        let p = c.start_call("calc", "add", vec![2.into(), 3.into()], Map::new(), CallOptions::default()).unwrap();
        assert_eq!(p.wait_timeout(w).unwrap(), Value::Int(5));
    }
    // A default timeout, and one call that waits for ever instead.
    let reg = Registry::new();
    reg.register("calc", calc()).unwrap();
    let cfg = RpcConfig { default_timeout: Wait::For(Duration::from_millis(50)), ..RpcConfig::default() };
    let (_s, c) = Endpoint::pair(reg, Registry::new(), cfg).unwrap();
    let r = c.call("calc", "sleep", vec![0.2.into()]);
    assert!(matches!(r, Err(RpcError::Timeout { after, .. }) if after == Duration::from_millis(50)), "{r:?}");
    let forever = CallOptions { timeout: Some(Wait::Forever), ..Default::default() };
    assert_eq!(c.call_with("calc", "sleep", vec![0.2.into()], Map::new(), forever).unwrap(), Value::from("slept"));
}

#[test]
fn async_handlers_and_typed_proxy() {
    let (_s, c) = pair();
    assert_eq!(c.call("calc", "later", vec!["x".into()]).unwrap(), Value::from("x"));
    let e = c.call("calc", "forget", vec![]).unwrap_err().to_string();
    assert!(e.contains("dropped its responder"), "{e}");
    let calc = RemoteObject::new(&c, "calc");
    let r: i64 = calc.call("add", (40, 2)).unwrap();
    assert_eq!(r, 42);
    let h = c.registry().handle("none");
    assert!(h.is_err());
}

#[test]
fn peer_death_fails_every_pending_call() {
    let (s, c) = pair();
    let pend: Vec<_> = (0..5).map(|_| c.start_call("calc", "sleep", vec![5.into()], Map::new(), CallOptions::default()).unwrap()).collect();
    std::thread::sleep(Duration::from_millis(50));
    drop(s); // the server endpoint goes away: its socket closes
    let t0 = Instant::now();
    for p in pend {
        let r = p.wait();
        assert!(matches!(r, Err(RpcError::PeerGone(_))), "{r:?}");
    }
    assert!(t0.elapsed() < Duration::from_secs(2));
    assert!(c.is_closed());
    assert!(matches!(c.call("calc", "add", vec![1.into(), 1.into()]), Err(RpcError::PeerGone(_))));
}

#[test]
fn close_frame_is_answered_and_closes() {
    let (s, c) = pair();
    c.close(Duration::from_secs(2));
    let why = s.wait_closed();
    assert!(why.is_peer_gone(), "{why}");
    assert!(c.is_closed());
}

#[test]
fn tensors_as_file_system_refs_and_natively() {
    // Both sides accept file_system TensorRefs (off by default: see tests/fs_tensors.rs).
    let (_s, c) = {
        let (sr, cr) = (Registry::new(), Registry::new());
        sr.register("calc", calc()).unwrap();
        cr.register("peer", peer_service()).unwrap();
        Endpoint::pair(sr, cr, RpcConfig { accept_fs_tensors: true, ..RpcConfig::default() }).unwrap()
    };
    let t = Tensor::from_f32(&[2, 2], &[1.0, 2.0, 3.0, 4.5]).unwrap();
    // Without negotiation: file_system TensorRef.
    let r = c.call("calc", "describe", vec![Value::from(t.clone())]).unwrap();
    assert_eq!(r, Value::Array(vec!["float32".into(), Value::Float(10.5)]));
    let got = c.call("calc", "make_tensor", vec![]).unwrap();
    let gt = got.as_tensor().unwrap();
    assert!(matches!(gt, Tensor::File(_)));
    assert_eq!(gt.to_f64_vec().unwrap(), vec![1., 2., 3., 4., 5., 6.]);
    // Native: memfd by fd over a tensorwire Peer, under a lease.
    assert!(c.negotiate_native(Duration::from_secs(5)).unwrap());
    assert!(c.native_enabled());
    let r = c.call("calc", "describe", vec![Value::from(t)]).unwrap();
    assert_eq!(r, Value::Array(vec!["float32".into(), Value::Float(10.5)]));
    let got = c.call("calc", "make_tensor", vec![]).unwrap();
    let gt = got.as_tensor().unwrap();
    assert!(matches!(gt, Tensor::Imported(_)), "{gt:?}");
    assert_eq!(gt.shape(), vec![2, 3]);
    assert_eq!(gt.to_f64_vec().unwrap(), vec![1., 2., 3., 4., 5., 6.]);
}

/// The side that accepted a negotiation sets its native channel up in the background,
/// after its answer: a tensor it sends right away (the answer to the very first call)
/// waits for that set-up and goes natively, never as a file-system reference the
/// initiator refuses or would map. On fresh connections, many times, to meet the window.
#[test]
fn the_first_answer_after_a_negotiation_is_native() {
    for round in 0..30 {
        let (_s, c) = pair();
        assert!(c.negotiate_native(Duration::from_secs(5)).unwrap());
        let got = c.call("calc", "make_tensor", vec![]).unwrap();
        let gt = got.as_tensor().unwrap();
        assert!(matches!(gt, Tensor::Imported(_)), "round {round}: the first answer came as {gt:?}");
        assert_eq!(gt.to_f64_vec().unwrap(), vec![1., 2., 3., 4., 5., 6.]);
    }
}

/// A tensor received natively and sent back (as it came, or another view of its storage)
/// travels as the sender's own memory: the transport forwards the producer's memfd, so a
/// write through the sender's tensor after the round trip shows in what came back. A copy
/// (the path that packed an import into a fresh segment) would not see it.
#[test]
fn a_received_tensor_sent_back_is_the_senders_memory_not_a_copy() {
    let (s, c) = pair();
    assert!(c.negotiate_native(Duration::from_secs(5)).unwrap());
    let deadline = Instant::now() + Duration::from_secs(5);
    while !s.native_enabled() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    let Tensor::Shared(mine) = Tensor::from_f32(&[4], &[1.0, 2.0, 3.0, 4.0]).unwrap() else { unreachable!() };
    let back = c.call("calc", "echo", vec![Value::from(Tensor::Shared(mine.clone()))]).unwrap();
    let back = back.as_tensor().unwrap().clone();
    assert!(matches!(back, Tensor::Imported(_)), "{back:?}");
    assert_eq!(back.to_f64_vec().unwrap(), vec![1.0, 2.0, 3.0, 4.0]);
    let tail = c.call("calc", "echo_tail", vec![Value::from(Tensor::Shared(mine.clone()))]).unwrap();
    let tail = tail.as_tensor().unwrap().clone();
    assert_eq!(tail.shape(), vec![2]);
    assert_eq!(tail.to_f64_vec().unwrap(), vec![3.0, 4.0]);
    mine.write_storage(8, &9.5f32.to_ne_bytes()).unwrap();
    assert_eq!(back.to_f64_vec().unwrap(), vec![1.0, 2.0, 9.5, 4.0], "the echo is the sender's memory");
    assert_eq!(tail.to_f64_vec().unwrap(), vec![9.5, 4.0], "the view sent back is the sender's memory");
}

/// Native tensors are taken from the transport by the thread that decodes the frame
/// naming them; what no frame names yet is the sweeper's. A sender blocks on a full
/// transport while it puts a frame's tensors there, before the frame: only the sweeper
/// can make room, so without it this call would hang until its send timeout.
#[test]
fn a_frame_naming_more_tensors_than_the_transport_holds_arrives() {
    let (s, c) = pair();
    assert!(c.negotiate_native(Duration::from_secs(5)).unwrap());
    let deadline = Instant::now() + Duration::from_secs(5);
    while !s.native_enabled() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    let t = Tensor::from_f32(&[2], &[1.0, 2.0]).unwrap();
    // Each native tensor is a transport message of ~0.4 KiB; a socket's default buffer
    // holds a few hundred of them.
    let n = 3000;
    let many = Value::Array((0..n).map(|_| Value::from(t.clone())).collect());
    let opts = CallOptions { timeout: Some(Duration::from_secs(20).into()), ..Default::default() };
    let r = c.call_with("calc", "count", vec![many], Map::new(), opts).unwrap();
    assert_eq!(r, Value::Int(n));
}

/// The peer's segment stays mapped after its tensor is dropped (the next tensor in it
/// costs no `mmap`), and goes once the peer frees the segment — with no further call to
/// take the peer's word for it from the transport.
#[test]
fn a_mapping_goes_when_the_peer_frees_its_segment_without_another_call() {
    let (s, c) = pair();
    assert!(c.negotiate_native(Duration::from_secs(5)).unwrap());
    let t = Tensor::from_f32(&[2, 2], &[1.0, 2.0, 3.0, 4.5]).unwrap();
    let r = c.call("calc", "describe", vec![Value::from(t.clone())]).unwrap();
    assert_eq!(r, Value::Array(vec!["float32".into(), Value::Float(10.5)]));
    assert_eq!(s.native_imported_segments(), Some(1));
    drop(t);
    let deadline = Instant::now() + Duration::from_secs(5);
    while s.native_imported_segments() != Some(0) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(s.native_imported_segments(), Some(0), "the freed segment is still mapped");
}

/// The CPUs this thread may run on.
fn allowed_cpus() -> Vec<usize> {
    // SAFETY: zeroed is the empty set; the call fills a set of the size passed; 0: this
    // thread; CPU_ISSET reads bits below CPU_SETSIZE.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        assert_eq!(libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set), 0);
        (0..libc::CPU_SETSIZE as usize).filter(|&c| libc::CPU_ISSET(c, &set)).collect()
    }
}

/// Pin the calling thread to `cpu`.
fn pin(cpu: usize) {
    // SAFETY: zeroed is the empty set; CPU_SET writes a bit below CPU_SETSIZE (a CPU the
    // kernel named); sched_setaffinity reads a set of the size passed; 0: this thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        assert_eq!(libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set), 0, "pinning to CPU {cpu}");
    }
}

/// With native tensors, each frame notes the CPU it was written from where the peer's
/// waits look (the transport's shared page), as the transport's own sends do: a wait
/// that finds the peer on its CPU then moves off it instead of sharing a core. A call
/// carrying no tensor sends nothing on the transport, so only the frame can say it.
#[test]
fn each_frame_notes_the_cpu_it_was_written_from() {
    let cpus = allowed_cpus();
    std::thread::spawn(move || {
        // Every endpoint thread starts from this thread's affinity: one CPU, so none of
        // them can move, and none writes its new CPU into the word this test reads.
        pin(cpus[cpus.len() - 1]);
        let (s, c) = pair();
        assert!(c.negotiate_native(Duration::from_secs(5)).unwrap());
        // The server finishes its side of the negotiation after it answers.
        let deadline = Instant::now() + Duration::from_secs(5);
        while !s.native_enabled() {
            assert!(Instant::now() < deadline, "the server never set up native tensors");
            std::thread::sleep(Duration::from_millis(1));
        }
        for &cpu in cpus.iter().rev().take(2) {
            pin(cpu);
            assert_eq!(c.call("calc", "add", vec![Value::Int(1), Value::Int(2)]).unwrap(), Value::Int(3));
            assert_eq!(s.native_peer_cpu(), Some(cpu as u32), "the call was written from CPU {cpu}");
        }
    })
    .join()
    .unwrap();
}

#[test]
fn tcp_transport() {
    let reg = Registry::new();
    reg.register("calc", calc()).unwrap();
    let server = Server::bind("tcp://127.0.0.1:0", reg, RpcConfig::default()).unwrap();
    let addr = server.local_addr();
    let t = std::thread::spawn(move || {
        let ep = server.accept().unwrap();
        ep.wait_closed();
    });
    let c = Endpoint::connect(&addr, Registry::new(), RpcConfig::default()).unwrap();
    assert_eq!(c.call("calc", "add", vec![2.into(), 3.into()]).unwrap(), Value::Int(5));
    assert!(!c.negotiate_native(Duration::from_secs(1)).unwrap(), "no native tensors over TCP");
    // Tensors are copied into the JSON (TensorValue) both ways over TCP.
    let tt = Tensor::from_f32(&[2, 2], &[1.0, 2.0, 3.0, 4.5]).unwrap();
    let r = c.call("calc", "describe", vec![Value::from(tt)]).unwrap();
    assert_eq!(r, Value::Array(vec!["float32".into(), Value::Float(10.5)]));
    let got = c.call("calc", "make_tensor", vec![]).unwrap();
    assert_eq!(got.as_tensor().unwrap().to_f64_vec().unwrap(), vec![1., 2., 3., 4., 5., 6.]);
    assert_eq!(got.as_tensor().unwrap().shape(), vec![2, 3]);
    c.close(Duration::from_secs(1));
    t.join().unwrap();
}

#[test]
fn a_sync_handler_on_the_reader_thread_leaves_the_socket_to_the_standby() {
    // Sync handlers run on the server's reader thread when nothing waits behind them
    // (RpcConfig::inline_sync), the socket handed to a standby meanwhile. One that blocks
    // until a later request releases it must not stop that request from being read; one
    // that calls its peer back while the peer waits on it must not deadlock; one that
    // panics is answered with an error and the connection keeps serving.
    let (gate_tx, gate_rx) = std::sync::mpsc::channel::<()>();
    let gate_rx = Arc::new(std::sync::Mutex::new(gate_rx));
    let threads = Arc::new(std::sync::Mutex::new(Vec::new()));
    let (t1, t2) = (threads.clone(), threads.clone());
    let svc = Service::new("Held")
        .method("wait_for_open", move |_, _| {
            t1.lock().unwrap().push(std::thread::current().name().map(str::to_owned));
            gate_rx.lock().unwrap().recv_timeout(Duration::from_secs(10)).map_err(|_| RpcError::Remote("never opened".into()))?;
            Ok(Value::from("opened"))
        })
        .method("open", move |_, _| {
            gate_tx.send(()).unwrap();
            Ok(Value::Null)
        })
        .method("where", move |_, _| {
            t2.lock().unwrap().push(std::thread::current().name().map(str::to_owned));
            Ok(Value::Null)
        })
        .method("ask_back", |ctx, a| ctx.call("peer", "double", a.args, Map::new()))
        .method("panic", |_, _| panic!("a handler that panics"));
    let s = Registry::new();
    s.register("held", svc).unwrap();
    let c = Registry::new();
    c.register("peer", Service::new("Peer").method("double", |_, a| Ok(Value::Int(2 * a.req(0, "n")?.as_i64().unwrap())))).unwrap();
    let (_server, client) = Endpoint::pair(s, c, RpcConfig::default()).unwrap();

    // A lone request runs on the reader thread itself (no hand-off to the pool).
    client.call("held", "where", vec![]).unwrap();
    assert_eq!(threads.lock().unwrap().pop().flatten().as_deref(), Some("tensorwire-rpc-reader"));

    let held = client.start_call("held", "wait_for_open", vec![], Map::new(), CallOptions::default()).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while threads.lock().unwrap().is_empty() {
        assert!(Instant::now() < deadline, "the held request should start");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(threads.lock().unwrap().pop().flatten().as_deref(), Some("tensorwire-rpc-reader"));
    // While the reader thread is held, the standby reads the next requests.
    let opts = || CallOptions { timeout: Some(Duration::from_secs(10).into()), ..CallOptions::default() };
    assert_eq!(client.call_with("held", "ask_back", vec![21.into()], Map::new(), opts()).unwrap(), Value::Int(42));
    client.call_with("held", "open", vec![], Map::new(), opts()).unwrap();
    assert_eq!(held.wait_timeout(Duration::from_secs(10)).unwrap(), Value::from("opened"));

    // A handler on the reader thread that calls its peer back (the peer waiting on it).
    assert_eq!(client.call_with("held", "ask_back", vec![5.into()], Map::new(), opts()).unwrap(), Value::Int(10));
    // A panic is an error answer, and the reader thread still serves.
    let e = client.call_with("held", "panic", vec![], Map::new(), opts()).unwrap_err().to_string();
    assert!(e.contains("panicked"), "{e}");
    for _ in 0..100 {
        assert_eq!(client.call_with("held", "ask_back", vec![1.into()], Map::new(), opts()).unwrap(), Value::Int(2));
    }
}

#[test]
fn inline_sync_off_runs_every_sync_handler_on_the_pool() {
    let seen = Arc::new(std::sync::Mutex::new(None));
    let s2 = seen.clone();
    let s = Registry::new();
    s.register("x", Service::new("X").method("where", move |_, _| {
        *s2.lock().unwrap() = std::thread::current().name().map(str::to_owned);
        Ok(Value::Null)
    }))
    .unwrap();
    let cfg = RpcConfig { inline_sync: false, ..RpcConfig::default() };
    let (_server, client) = Endpoint::pair(s, Registry::new(), cfg).unwrap();
    client.call("x", "where", vec![]).unwrap();
    assert_eq!(seen.lock().unwrap().as_deref(), Some("tensorwire-rpc-worker"));
}

/// A transport error keeps the transport's kind (`RpcError::kind`), and its text as
/// before: a native tensor over the sender's lease byte limit fails its call with
/// `QuotaExceeded`, and a response naming a native tensor the receiver refuses (over its
/// mapped-bytes limit) fails the call with the refusal's kind.
#[test]
fn a_transport_error_keeps_the_transports_kind() {
    let (sr, cr) = (Registry::new(), Registry::new());
    sr.register("calc", calc()).unwrap();
    let (x, y) = Stream::pair().unwrap();
    let _s = Endpoint::new(x, sr, RpcConfig::default()).unwrap();
    let mut cfg = RpcConfig::default();
    cfg.peer_config.max_lease_bytes = 64;
    cfg.peer_config.max_import_mapped_bytes = 16;
    let c = Endpoint::new(y, cr, cfg).unwrap();
    assert!(c.negotiate_native(Duration::from_secs(5)).unwrap());
    let big = Tensor::from_f32(&[1024], &[1.0; 1024]).unwrap();
    let e = c.call("calc", "describe", vec![Value::from(big)]).unwrap_err();
    assert_eq!(e.kind(), Some(tensorwire::ErrorKind::QuotaExceeded), "{e:?}");
    assert!(matches!(&e, RpcError::Transport { kind: tensorwire::ErrorKind::QuotaExceeded, .. }), "{e:?}");
    assert!(e.to_string().starts_with("transport: "), "{e}");
    let e = c.call("calc", "make_tensor", vec![]).unwrap_err();
    assert_eq!(e.kind(), Some(tensorwire::ErrorKind::QuotaExceeded), "{e:?}");
    assert!(e.to_string().starts_with("transport: native tensor ") && e.to_string().contains("was refused"), "{e}");
    // Neither ended the connection.
    assert_eq!(c.call("calc", "add", vec![1.into(), 2.into()]).unwrap(), Value::Int(3));
}
