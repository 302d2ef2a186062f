//! What queued work does at exit, the cross-process cost model, simcuda's off-switches and counters.

use super::*;

/// A child opens the parent's IPC handle, writes it with `cuMemcpyHtoD_v2` from pageable
/// memory (staged and queued, behind a blocking stream's work), closes the handle and
/// exits normally: the parent reads the child's bytes (on an H200 it does). Once with a
/// `cuCtxSynchronize` after the close (the close must keep the pages for the queued copy),
/// once without (the exit must finish the queued copy).
#[test]
fn work_queued_before_a_normal_exit_completes() {
    if !gpu("work_queued_before_a_normal_exit_completes") {
        return;
    }
    for (mode, seed) in [("sync_after_close", 11u8), ("exit", 12u8)] {
        let b = DeviceBuffer::alloc(0, 1 << 16).unwrap();
        htod(b.ptr(), &[0u8; 1 << 16]);
        let mut h = sys::CUipcMemHandle { reserved: [0; 64] };
        {
            let _c = ensure_context(0).unwrap();
            // SAFETY: valid out-pointer; the base of a live allocation.
            assert_eq!(unsafe { sys::cuIpcGetMemHandle(&mut h, b.ptr().get()) }, OK);
        }
        let env = [
            (HANDLE_ENV, hex(&h.reserved)),
            (MODE_ENV, format!("{mode}:{seed}")),
            // simcuda: every op of the child waits up to 20 ms, so the copy is still queued at exit.
            ("SIMCUDA_MAX_DELAY_US", "20000".to_string()),
        ];
        let (st, err) = Kid::spawn("exit_write", &env, None).finish();
        assert!(st.success(), "{mode}: {st:?}: {err}");
        assert_eq!(dtoh(b.ptr(), 1 << 16), pattern(seed, 1 << 16), "{mode}: the child's queued copy did not land");
    }
}

pub(super) fn child_exit_write() {
    let h = sys::CUipcMemHandle { reserved: unhex(&std::env::var(HANDLE_ENV).unwrap()) };
    let mode = std::env::var(MODE_ENV).unwrap();
    let (mode, seed) = mode.split_once(':').unwrap();
    let bytes = pattern(seed.parse().unwrap(), 1 << 16);
    assert!(tensorwire::cuda::available());
    let blocking = Stream::new();
    let scratch = DeviceBuffer::alloc(0, 4096).unwrap();
    // Work ahead of the copy on a blocking stream: the legacy-stream copy waits for it.
    for _ in 0..10 {
        memset_async(scratch.ptr(), 1, 4096, blocking.0);
    }
    let _c = ensure_context(0).unwrap();
    let mut p = 0;
    let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
    // SAFETY: the parent's handle; `bytes` is readable for its length (pageable: staged).
    unsafe {
        assert_eq!(sys::cuIpcOpenMemHandle_v2(&mut p, h, flags), OK);
        assert_eq!(sys::cuMemcpyHtoD_v2(p, bytes.as_ptr().cast(), bytes.len()), OK);
        assert_eq!(sys::cuIpcCloseMemHandle(p), OK);
        if mode == "sync_after_close" {
            assert_eq!(sys::cuCtxSynchronize(), OK);
        }
    }
    std::process::exit(0);
}

/// simcuda-only: the exit drain is bounded (`SIMCUDA_EXIT_DRAIN_MS`): a stream parked on
/// a word nobody writes does not hold the exit forever, and the exit says so on stderr.
#[test]
fn the_exit_drain_gives_up_on_a_stream_that_cannot_finish() {
    if !sim_only("the_exit_drain_gives_up_on_a_stream_that_cannot_finish") {
        return;
    }
    let t0 = Instant::now();
    let (st, err) = Kid::spawn("exit_stuck", &[("SIMCUDA_EXIT_DRAIN_MS", "300".to_string())], None).finish();
    let took = t0.elapsed();
    assert!(st.success(), "{st:?}: {err}");
    assert!(err.contains("simcuda: at exit, queued work left unfinished"), "no note on stderr: {err}");
    assert!(took >= Duration::from_millis(300), "the exit did not wait for the queued work: {took:?}");
    assert!(took < Duration::from_secs(8), "the bound was not kept: {took:?}");
}

pub(super) fn child_exit_stuck() {
    assert!(tensorwire::cuda::available());
    let d = DeviceBuffer::alloc(0, 4).unwrap();
    htod(d.ptr(), &[0u8; 4]);
    let s = NbStream::new();
    let _c = ensure_context(0).unwrap();
    assert_eq!(wait32(s.0, d.ptr().get(), 1, GEQ), OK);
    std::mem::forget((d, s));
    std::process::exit(0);
}

/// simcuda-only: a stream waiting on an event whose recording process died (SIGKILL while
/// the record was pending) can never finish: the exit does not wait for it at all, even
/// with the default 10 s bound.
#[test]
fn the_exit_drain_does_not_wait_for_a_dead_peers_event() {
    if !sim_only("the_exit_drain_does_not_wait_for_a_dead_peers_event") {
        return;
    }
    let _c = ensure_context(0).unwrap();
    let mut ev: sys::CUevent = std::ptr::null_mut();
    let mut h = sys::CUipcEventHandle { reserved: [0; 64] };
    let flags = (sys::CUevent_flags::CU_EVENT_INTERPROCESS as u32) | (sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32);
    // SAFETY: valid out-pointers.
    unsafe {
        assert_eq!(sys::cuEventCreate(&mut ev, flags), OK);
        assert_eq!(sys::cuIpcGetEventHandle(&mut h, ev), OK);
    }
    let env = [(HANDLE_ENV, hex(&h.reserved))];
    let mut recorder = Kid::spawn("record_pending", &env, None);
    recorder.expect("RECORDED");
    kill9(&mut recorder.child);
    let t0 = Instant::now();
    let (st, err) = Kid::spawn("exit_orphan", &env, None).finish();
    let took = t0.elapsed();
    assert!(st.success(), "{st:?}: {err}");
    assert!(err.contains("recording process is gone"), "no note on stderr: {err}");
    assert!(took < Duration::from_secs(5), "the exit waited on a dead peer's event: {took:?}");
    // SAFETY: a live event, destroyed once.
    assert_eq!(unsafe { sys::cuEventDestroy_v2(ev) }, OK);
}

fn open_event_from_env() -> sys::CUevent {
    let h = sys::CUipcEventHandle { reserved: unhex(&std::env::var(HANDLE_ENV).unwrap()) };
    assert!(tensorwire::cuda::available());
    let _c = ensure_context(0).unwrap();
    let mut ev: sys::CUevent = std::ptr::null_mut();
    // SAFETY: valid out-pointer; the parent's handle.
    assert_eq!(unsafe { sys::cuIpcOpenEventHandle(&mut ev, h) }, OK);
    ev
}

pub(super) fn child_record_pending() {
    let ev = open_event_from_env();
    let d = DeviceBuffer::alloc(0, 4).unwrap();
    htod(d.ptr(), &[0u8; 4]);
    let s = NbStream::new();
    let _c = ensure_context(0).unwrap();
    assert_eq!(wait32(s.0, d.ptr().get(), 1, GEQ), OK);
    // SAFETY: an opened event and a live stream.
    assert_eq!(unsafe { sys::cuEventRecord(ev, s.0) }, OK);
    println!("RECORDED");
    let _ = std::io::stdin().read(&mut [0u8]);
    std::process::exit(0);
}

pub(super) fn child_exit_orphan() {
    let ev = open_event_from_env();
    let s = NbStream::new();
    let _c = ensure_context(0).unwrap();
    // SAFETY: an opened event and a live stream.
    assert_eq!(unsafe { sys::cuStreamWaitEvent(s.0, ev, 0) }, OK);
    std::mem::forget(s);
    std::process::exit(0);
}

/// simcuda-only: a stream wait on a record another process made is counted as a
/// cross-process event wait and costs `SIMCUDA_XPROC_WAIT_US` on the stream (the measured
/// GPU time-slice switch), but nothing with `SIMCUDA_MPS=1` and nothing on host waits; a
/// wait on this process's own record is not counted.
#[test]
fn cross_process_event_stream_waits_are_counted_and_cost_a_time_slice() {
    if !sim_only("cross_process_event_stream_waits_are_counted_and_cost_a_time_slice") {
        return;
    }
    let _c = ensure_context(0).unwrap();
    let s = NbStream::new();
    let mut ev: sys::CUevent = std::ptr::null_mut();
    let mut h = sys::CUipcEventHandle { reserved: [0; 64] };
    let flags = (sys::CUevent_flags::CU_EVENT_INTERPROCESS as u32) | (sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32);
    // SAFETY: valid out-pointers; a live stream.
    unsafe {
        assert_eq!(sys::cuEventCreate(&mut ev, flags), OK);
        assert_eq!(sys::cuEventRecord(ev, s.0), OK);
        assert_eq!(sys::cuIpcGetEventHandle(&mut h, ev), OK);
    }
    s.sync();
    let run = |mps: &str| {
        let env = [
            (HANDLE_ENV, hex(&h.reserved)),
            ("SIMCUDA_XPROC_WAIT_US", "20000".to_string()),
            ("SIMCUDA_MAX_DELAY_US", "0".to_string()),
            ("SIMCUDA_MPS", mps.to_string()),
        ];
        let mut kid = Kid::spawn("xproc_event", &env, None);
        let line = kid.expect("RESULT");
        let (st, err) = kid.finish();
        assert!(st.success(), "{st:?}: {err}");
        let field = |k: &str| -> u64 {
            line.split_whitespace().find_map(|f| f.strip_prefix(&format!("{k}="))).unwrap().parse().unwrap()
        };
        (field("waits"), field("stream_ms"), field("host_ms"))
    };
    let (waits, stream_ms, host_ms) = run("0");
    assert_eq!(waits, 8, "8 waits on the parent's record, none on the child's own");
    assert!(stream_ms >= 8 * 20, "each cross-process stream wait costs 20 ms: {stream_ms} ms");
    assert!(host_ms < 80, "host waits cost nothing: {host_ms} ms");
    let (waits, stream_ms, _) = run("1");
    assert_eq!(waits, 8, "counted under MPS too");
    assert!(stream_ms < 80, "no time-slice switch under MPS: {stream_ms} ms");
    // SAFETY: a live event, destroyed once.
    assert_eq!(unsafe { sys::cuEventDestroy_v2(ev) }, OK);
}

pub(super) fn child_xproc_event() {
    let ev = open_event_from_env();
    let s = NbStream::new();
    let _c = ensure_context(0).unwrap();
    let before = sim_stats().unwrap().xproc_event_waits;
    let t0 = Instant::now();
    for _ in 0..8 {
        // SAFETY: an opened event and a live stream.
        assert_eq!(unsafe { sys::cuStreamWaitEvent(s.0, ev, 0) }, OK);
        s.sync();
    }
    let stream_ms = t0.elapsed().as_millis();
    let t0 = Instant::now();
    for _ in 0..8 {
        // SAFETY: an opened event.
        unsafe {
            assert_eq!(sys::cuEventSynchronize(ev), OK);
            assert_eq!(sys::cuEventQuery(ev), OK);
        }
    }
    let host_ms = t0.elapsed().as_millis();
    // This process's own record: not a cross-process wait.
    // SAFETY: an opened event and a live stream.
    unsafe {
        assert_eq!(sys::cuEventRecord(ev, s.0), OK);
        assert_eq!(sys::cuStreamWaitEvent(s.0, ev, 0), OK);
    }
    s.sync();
    let waits = sim_stats().unwrap().xproc_event_waits - before;
    println!("RESULT waits={waits} stream_ms={stream_ms} host_ms={host_ms}");
    std::process::exit(0);
}

/// simcuda-only: `SIMCUDA_VALUE_WAIT_US` is added to each stream value wait once its
/// condition holds (the cost model; 0 by default).
#[test]
fn stream_value_waits_cost_simcuda_value_wait_us() {
    if !sim_only("stream_value_waits_cost_simcuda_value_wait_us") {
        return;
    }
    let run = |us: &str| -> u64 {
        let env = [("SIMCUDA_VALUE_WAIT_US", us.to_string()), ("SIMCUDA_MAX_DELAY_US", "0".to_string())];
        let mut kid = Kid::spawn("value_wait_cost", &env, None);
        let line = kid.expect("RESULT ms=");
        let (st, err) = kid.finish();
        assert!(st.success(), "{st:?}: {err}");
        line["RESULT ms=".len()..].parse().unwrap()
    };
    let ms = run("20000");
    assert!(ms >= 5 * 20, "5 waits of 20 ms each: {ms} ms");
    let ms = run("0");
    assert!(ms < 80, "no cost by default: {ms} ms");
}

pub(super) fn child_value_wait_cost() {
    assert!(tensorwire::cuda::available());
    let w = HostWords::new();
    let s = NbStream::new();
    let _c = ensure_context(0).unwrap();
    let t0 = Instant::now();
    for _ in 0..5 {
        assert_eq!(wait32(s.0, w.dptr(0), 0, GEQ), OK);
        s.sync();
    }
    println!("RESULT ms={}", t0.elapsed().as_millis());
    drop(w);
    std::process::exit(0);
}

/// simcuda-only: `SIMCUDA_NO_MEMOPS=1` and `SIMCUDA_NO_HOST_REGISTER=1` turn support off
/// (attributes 0, calls CUDA_ERROR_NOT_SUPPORTED) so fallbacks can be tested; each leaves
/// the other capability alone. `SIMCUDA_MPS=1` reports MPS_ENABLED.
#[test]
fn the_off_switches_report_and_refuse() {
    if !sim_only("the_off_switches_report_and_refuse") {
        return;
    }
    for (k, mode) in [("SIMCUDA_NO_MEMOPS", "no_memops"), ("SIMCUDA_NO_HOST_REGISTER", "no_host_register"), ("SIMCUDA_MPS", "mps")] {
        let env = [(k, "1".to_string()), (MODE_ENV, mode.to_string())];
        let (st, err) = Kid::spawn("switches", &env, None).finish();
        assert!(st.success(), "{k}=1: {st:?}: {err}");
    }
}

pub(super) fn child_switches() {
    use sys::CUdevice_attribute::*;
    let mode = std::env::var(MODE_ENV).unwrap();
    assert!(tensorwire::cuda::available());
    let (no_memops, no_register) = (mode == "no_memops", mode == "no_host_register");
    for a in [CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR] {
        assert_eq!(attr(a), i32::from(!no_memops), "{a:?}");
    }
    assert_eq!(attr(CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED), i32::from(!no_register));
    assert_eq!(attr(CU_DEVICE_ATTRIBUTE_MPS_ENABLED), i32::from(mode == "mps"));
    let d = DeviceBuffer::alloc(0, 64).unwrap();
    htod(d.ptr(), &[0u8; 64]);
    let s = NbStream::new();
    let _c = ensure_context(0).unwrap();
    let want = if no_memops { NOT_SUPPORTED } else { OK };
    let a = d.ptr().get();
    assert_eq!(wait32(s.0, a, 0, GEQ), want);
    assert_eq!(wait64(s.0, a, 0, GEQ), want);
    assert_eq!(write32(s.0, a + 8, 1, 0), want);
    assert_eq!(write64(s.0, a + 16, 1, 0), want);
    let mut x = [0u64; 512];
    let r = unsafe {
        // SAFETY: the array lives until after the unregister below.
        sys::cuMemHostRegister_v2(x.as_mut_ptr().cast(), 4096, DEVICEMAP)
    };
    assert_eq!(r, if no_register { NOT_SUPPORTED } else { OK });
    if r == OK {
        // SAFETY: registered just above.
        assert_eq!(unsafe { sys::cuMemHostUnregister(x.as_mut_ptr().cast()) }, OK);
    }
    s.sync();
    std::process::exit(0);
}

/// simcuda-only: the counters of stream value ops and host registrations (exact, in a
/// child process of its own) and the stats layout version.
#[test]
fn stats_count_value_ops_and_host_registrations() {
    if !sim_only("stats_count_value_ops_and_host_registrations") {
        return;
    }
    assert_eq!(sim_stats().unwrap().version, SIM_STATS_VERSION, "simcuda_stats layout version");
    let (st, err) = Kid::spawn("count_ops", &[], None).finish();
    assert!(st.success(), "{st:?}: {err}");
}

pub(super) fn child_count_ops() {
    assert!(tensorwire::cuda::available());
    let before = sim_stats().unwrap();
    let w = HostWords::new();
    assert_eq!(sim_stats().unwrap().host_registrations, before.host_registrations + 1);
    let s = NbStream::new();
    let _c = ensure_context(0).unwrap();
    w.u64(0).store(1, Ordering::SeqCst);
    assert_eq!(wait32(s.0, w.dptr(0), 1, GEQ), OK);
    assert_eq!(wait64(s.0, w.dptr(0), 1, EQ), OK);
    assert_eq!(wait32(s.0, w.dptr(0), 1, AND), OK);
    assert_eq!(write32(s.0, w.dptr(8), 1, 0), OK);
    assert_eq!(write64(s.0, w.dptr(16), 1, 0), OK);
    assert_eq!(wait32(s.0, w.dptr(2), 1, GEQ), INVALID_VALUE, "a refused call is not counted");
    s.sync();
    let after = sim_stats().unwrap();
    assert_eq!((after.value_waits - before.value_waits, after.value_writes - before.value_writes), (3, 2));
    drop(w);
    assert_eq!(sim_stats().unwrap().host_registrations, before.host_registrations);
    std::process::exit(0);
}

/// `SIMCUDA_CTX_SWITCH_US`: engine work (a copy, a memset) that follows another live
/// process's on the device pays a time-slice switch; back-to-back work of one process does
/// not, nor anything under MPS (the H200's measured cost, modelled: simcuda/src/timeslice.rs).
#[test]
fn engine_work_after_another_processs_pays_a_time_slice_switch() {
    if !sim_only("engine_work_after_another_processs_pays_a_time_slice_switch") {
        return;
    }
    let file = std::env::temp_dir().join(format!("simcuda-timeslice-test-{}", std::process::id()));
    let run = |mps: &str| {
        // The device's last engine work: this (live) process's.
        let mut page = vec![0u8; 4096];
        page[..4].copy_from_slice(&std::process::id().to_le_bytes());
        std::fs::write(&file, &page).unwrap();
        let env = [
            ("SIMCUDA_TIMESLICE_FILE", file.display().to_string()),
            ("SIMCUDA_CTX_SWITCH_US", "20000".to_string()),
            ("SIMCUDA_MAX_DELAY_US", "0".to_string()),
            ("SIMCUDA_MPS", mps.to_string()),
        ];
        let mut kid = Kid::spawn("timeslice", &env, None);
        let line = kid.expect("RESULT");
        let (st, err) = kid.finish();
        assert!(st.success(), "{st:?}: {err}");
        let field = |k: &str| -> u64 {
            line.split_whitespace().find_map(|f| f.strip_prefix(&format!("{k}="))).unwrap().parse().unwrap()
        };
        (field("first_ms"), field("rest_ms"), u32::from_le_bytes(std::fs::read(&file).unwrap()[..4].try_into().unwrap()))
    };
    let (first, rest, last) = run("0");
    assert!(first >= 20, "the first memset follows another process's work: {first} ms");
    assert!(rest < 20, "three more of its own pay nothing: {rest} ms");
    assert_ne!(last, std::process::id(), "the kid's work is now the device's last");
    let (first, _, _) = run("1");
    assert!(first < 20, "no switch is paid under MPS: {first} ms");
    let _ = std::fs::remove_file(&file);
}

pub(super) fn child_timeslice() {
    let b = DeviceBuffer::alloc(0, 4096).unwrap();
    let s = NbStream::new();
    let t0 = Instant::now();
    memset_async(b.ptr(), 1, 4096, tensorwire::cuda::CudaStream(s.0 as usize));
    s.sync();
    let first_ms = t0.elapsed().as_millis();
    let t0 = Instant::now();
    for v in 2..5 {
        memset_async(b.ptr(), v, 4096, tensorwire::cuda::CudaStream(s.0 as usize));
        s.sync();
    }
    println!("RESULT first_ms={first_ms} rest_ms={}", t0.elapsed().as_millis());
}
