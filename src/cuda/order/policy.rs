//! `CudaWait`: how a process orders its work after another process's CUDA work.

use crate::error::{Error, Result};

/// How this side waits for the other process's CUDA work before using what it sent (an
/// import's memory, a GPU ring slot), per connection (`PeerConfig::cuda_wait`).
///
/// Without MPS two processes' contexts time-slice on the GPU, and a GPU-side wait on
/// another process's IPC event (`cuStreamWaitEvent`) costs a time-slice switch, an order
/// of magnitude more than a host wait on the same event or a stream-memory-op wait on a
/// shared word (`docs/DESIGN.md`, "CUDA events and stream order"; `docs/measurements.md`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[repr(u32)]
pub enum CudaWait {
    /// The GPU waits, the CPU returns at once: the producer writes a sequence word (a
    /// sealed memfd both processes register with CUDA) on its stream after its work,
    /// and this side's stream waits for it (`cuStreamWaitValue32`). A wait the peer never
    /// ends (it died, or it never writes) is ended by this side on the peer's death or
    /// after `cuda_wait_timeout`, and the import then reports a named error. Where the
    /// producer cannot write words, the IPC event is waited for on the host instead.
    #[default]
    Stream = 0,
    /// The receiving thread waits (a bounded spin on the word or the event, then
    /// sleeping polls; peer-death aware, bounded by `cuda_wait_timeout`): the lowest
    /// latency without MPS, but the call blocks until the producer's work completed.
    Host = 1,
    /// `cuStreamWaitEvent` on the producer's IPC event (the GPU waits). Pays the
    /// time-slice switch without MPS; under MPS it costs about what a word costs. For comparison and for
    /// MPS setups (where a fault in one client is reported to every client of the GPU,
    /// so it does not isolate untrusted code).
    Event = 2,
}

impl CudaWait {
    pub const ALL: [CudaWait; 3] = [CudaWait::Stream, CudaWait::Host, CudaWait::Event];

    /// The policy's name as the C ABI, Python and the docs spell it.
    pub fn name(self) -> &'static str {
        match self {
            CudaWait::Stream => "stream",
            CudaWait::Host => "host",
            CudaWait::Event => "event",
        }
    }

    /// From the number the C ABI and the torch options pass.
    pub fn from_code(code: u32) -> Result<CudaWait> {
        CudaWait::ALL.into_iter().find(|w| *w as u32 == code).ok_or_else(|| {
            Error::InvalidArgument(format!("CUDA wait policy {code} unknown (0: stream, 1: host, 2: event)"))
        })
    }
}

impl std::str::FromStr for CudaWait {
    type Err = Error;
    fn from_str(s: &str) -> Result<CudaWait> {
        CudaWait::ALL
            .into_iter()
            .find(|w| w.name() == s)
            .ok_or_else(|| Error::InvalidArgument(format!("CUDA wait policy {s:?} unknown (stream, host or event)")))
    }
}

impl std::fmt::Display for CudaWait {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_codes_round_trip_and_unknown_ones_are_named() {
        for w in CudaWait::ALL {
            assert_eq!(w.name().parse::<CudaWait>().unwrap(), w);
            assert_eq!(CudaWait::from_code(w as u32).unwrap(), w);
        }
        {
        let e = CudaWait::from_code(3).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("policy 3 unknown"), "{e}");
    }
        {
        let e = "gpu".parse::<CudaWait>().unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("\"gpu\" unknown"), "{e}");
    }
        assert_eq!(CudaWait::default(), CudaWait::Stream);
    }
}
