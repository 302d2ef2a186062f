//! What the integration tests share: the child-process harness (`process`), the CPU
//! roles children play (`child_main`), resource counts; the CUDA helpers (`gpu`,
//! `gpu_roles`).

#![allow(dead_code)]

pub mod gpu;
pub mod gpu_roles;
pub mod process;

pub use process::*;

use std::time::Duration;
use tensorwire::{DType, ExportOptions, Incoming, Layout, SharedTensor};

pub const QUERY: u64 = u64::MAX;
pub const DONE: u64 = u64::MAX - 1;

pub fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// Mappings of memfd segments in this process.
pub fn memfd_maps() -> usize {
    std::fs::read_to_string("/proc/self/maps").unwrap().lines().filter(|l| l.contains("/memfd:")).count()
}

/// Body of every test binary's ignored `child_entry` test: if this process was spawned
/// by `spawn_child`, play the role it was given.
pub fn child_main() {
    let Some((role, peer)) = child_peer() else { return };
    match role.as_str() {
        // Import, checksum, flip the first byte of the view, release, report.
        "verify" => loop {
            match peer.recv(T).unwrap() {
                Incoming::Tensor(t) => {
                    let sum = fnv1a(&t.to_vec().unwrap());
                    let l = t.layout();
                    let at = l.storage_offset as usize * l.dtype.size();
                    if l.numel() > 0 {
                        let mut b = [0u8];
                        t.read_storage(at, &mut b).unwrap();
                        t.write_storage(at, &[!b[0]]).unwrap();
                    }
                    let tag = t.tag();
                    t.release().unwrap();
                    peer.send_message(&words(&[tag, sum]), &[]).unwrap();
                }
                Incoming::Message { payload, .. } if payload == words(&[QUERY]) => {
                    peer.send_message(&words(&[peer.imported_segments() as u64]), &[]).unwrap();
                }
                Incoming::Message { .. } => return,
                Incoming::CudaTensor(t) => panic!("unexpected CUDA tensor {:?}", t.layout()),
            }
        },
        // Exit with the status the first message names (one word).
        "exit_with" => match peer.recv(T).unwrap() {
            Incoming::Message { payload, .. } if payload.len() == 8 => {
                std::process::exit(u64::from_le_bytes(payload.try_into().unwrap()) as i32)
            }
            other => panic!("exit_with: expected a one-word message, got {other:?}"),
        },
        // Import and keep everything until told to report, then wait to be killed.
        "hold" => {
            let mut held = Vec::new();
            loop {
                match peer.recv(T).unwrap() {
                    Incoming::Tensor(t) => held.push(t),
                    Incoming::Message { .. } => {
                        peer.send_message(&words(&[held.len() as u64]), &[]).unwrap();
                        break;
                    }
                    Incoming::CudaTensor(t) => panic!("unexpected CUDA tensor {:?}", t.layout()),
                }
            }
            let _ = peer.recv(tensorwire::Wait::Forever);
            std::process::exit(0);
        }
        // Export three patterned tensors, say so, then wait to be killed.
        "produce_and_die" => {
            let mut keep = Vec::new();
            for i in 0..3u8 {
                let t = SharedTensor::zeros(Layout::contiguous(DType::UInt8, &[4096]).unwrap()).unwrap();
                t.write_storage(0, &vec![i + 1; 4096]).unwrap();
                peer.export(&t, ExportOptions { tag: i as u64, window: None }).unwrap();
                keep.push(t);
            }
            peer.send_message(b"ready", &[]).unwrap();
            let _ = peer.recv(tensorwire::Wait::Forever);
            std::process::exit(0);
        }
        other => panic!("unknown child role {other}"),
    }
}

/// This thread's CPU time (user + system) so far.
pub fn thread_cpu() -> Duration {
    // SAFETY: getrusage writes one `rusage` into the zeroed value we own.
    let ru = unsafe {
        let mut ru: libc::rusage = std::mem::zeroed();
        assert_eq!(libc::getrusage(libc::RUSAGE_THREAD, &mut ru), 0);
        ru
    };
    let tv = |t: libc::timeval| Duration::from_secs(t.tv_sec as u64) + Duration::from_micros(t.tv_usec as u64);
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// An owner that counts its drops and keeps a segment alive.
pub struct Counted(pub std::sync::Arc<std::sync::atomic::AtomicUsize>, pub std::sync::Arc<tensorwire::Segment>);
impl Drop for Counted {
    fn drop(&mut self) {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}
