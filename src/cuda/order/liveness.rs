//! `PeerWatch`: is the process on the other end still alive? Asked by waits that must end
//! when it dies (a host wait, the watchdog of GPU-side waits), from any thread, after the
//! connection itself may be gone.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};

/// A process, watched through its pidfd (or, where the kernel has none, `kill(pid, 0)`).
#[derive(Debug)]
pub struct PeerWatch {
    pid: i32,
    pidfd: Option<OwnedFd>,
    dead: AtomicBool,
}

impl PeerWatch {
    pub fn new(pid: i32) -> PeerWatch {
        PeerWatch { pid, pidfd: crate::sys::pidfd_open(pid), dead: AtomicBool::new(false) }
    }

    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// True once the process exited (one `poll` of its pidfd while it lives).
    pub fn gone(&self) -> bool {
        // Relaxed: a sticky flag; what it says is re-derived from the kernel when unset.
        if self.dead.load(Ordering::Relaxed) {
            return true;
        }
        let dead = match &self.pidfd {
            Some(fd) => crate::sys::poll_readable(&[fd.as_fd()], crate::wait::Wait::Never).is_ok_and(|r| r[0]),
            None => {
                // SAFETY: signal 0 only checks that the process exists.
                let r = unsafe { libc::kill(self.pid, 0) };
                r != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
            }
        };
        if dead {
            // Relaxed: as above.
            self.dead.store(true, Ordering::Relaxed);
        }
        dead
    }
}
