//! The GPU's time slices between processes. Without MPS a device runs one context's work
//! at a time, and switching to another process's context costs a time-slice switch:
//! measured on an H200 (driver 580, CUDA 13, no MPS), a round trip in which both
//! processes run a small op costs ~330 µs against ~45 µs when only one of them does, about
//! 140 µs a switch; event records and stream memory operations did not pay it (a consumer
//! that only records a release mark and writes no bytes stayed at ~44 µs).
//!
//! `SIMCUDA_CTX_SWITCH_US=N` (default 0) models it: engine work (a copy or a memset) that
//! runs while the device's last engine work was another live process's sleeps N µs first,
//! unless `SIMCUDA_MPS=1`. The device's last worker is a pid in a one-page file every
//! simcuda process of the user maps (`SIMCUDA_TIMESLICE_FILE`, default
//! `$TMPDIR/simcuda-gpu-<uid>-<device>`); it is only read and written while the cost is on.

use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;

const FILE_BYTES: usize = 4096;

/// The shared word of `device` (one device is simulated: 0), mapped once per process.
fn last_worker() -> Option<&'static AtomicU32> {
    static WORD: OnceLock<Option<usize>> = OnceLock::new();
    let addr = *WORD.get_or_init(|| {
        let path = std::env::var_os("SIMCUDA_TIMESLICE_FILE").map(std::path::PathBuf::from).unwrap_or_else(|| {
            // SAFETY: getuid cannot fail.
            let uid = unsafe { libc::getuid() };
            std::env::temp_dir().join(format!("simcuda-gpu-{uid}-0"))
        });
        let file = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&path).ok()?;
        if file.metadata().ok()?.len() < FILE_BYTES as u64 {
            file.set_len(FILE_BYTES as u64).ok()?;
        }
        // SAFETY: a fresh shared mapping of a file of at least FILE_BYTES bytes; never
        // unmapped (it lives as long as the process).
        let p = unsafe {
            libc::mmap(std::ptr::null_mut(), FILE_BYTES, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, file.as_raw_fd(), 0)
        };
        (p != libc::MAP_FAILED).then_some(p as usize)
    });
    if addr.is_none() {
        static WARNED: std::sync::Once = std::sync::Once::new();
        WARNED.call_once(|| eprintln!("simcuda: cannot map the time-slice file; SIMCUDA_CTX_SWITCH_US has no effect"));
    }
    // SAFETY: a page-aligned mapping of FILE_BYTES bytes that is never unmapped; the word
    // at its start is only accessed atomically, by every process that maps the file.
    addr.map(|a| unsafe { &*(a as *const AtomicU32) })
}

/// Before engine work of this process runs: pay the switch if the device last ran
/// another live process's.
pub fn take_turn() {
    let s = crate::settings::get();
    if s.ctx_switch.is_zero() || s.mps {
        return;
    }
    let Some(word) = last_worker() else { return };
    let me = std::process::id();
    // Relaxed: the pid is the whole message; nothing else is published through it.
    let prev = word.swap(me, Ordering::Relaxed);
    if prev != 0 && prev != me && crate::process::alive(prev) {
        std::thread::sleep(s.ctx_switch);
    }
}
