//! What both halves share: the control segment (layout, consumer states, its words), the
//! chunk record format, and how a credit wait's failure reads.

use crate::credits::{CreditError, Credits};
use crate::desc::{TensorDesc, DESC_SIZE};
use crate::doorbell::DoorbellWords;
use crate::error::{Error, Result};
use crate::segment::Segment;
use std::sync::atomic::{AtomicU32, AtomicU64};
use crate::wait::Deadline;
use std::sync::Arc;
use std::time::Duration;

/// The CPU ring the chunk records travel through.
pub(super) const DESC_RING_BYTES: usize = 64 << 10;
/// How long a sleeping wait goes before it looks at the peer's liveness again.
pub(super) const LIVENESS_SLICE: Duration = Duration::from_millis(20);

// The control segment's layout and the consumer's states are in `wire::cuda_ring`.
pub(super) use crate::wire::cuda_ring::{
    HANDLES_AT, MODE_EVENTS, MODE_WORDS, FLAG_FIRST, FLAG_LAST, STATE_AT, STATE_BROKEN, STATE_CLOSED,
    STATE_READY, STATE_REFUSED,
};
use crate::wire::cuda_ring::{BELL_AT, FREED_AT, MODE_AT, REC_HEADER, REC_MAGIC};

pub(super) fn ctrl_bytes(slots: u32) -> usize {
    HANDLES_AT + slots as usize * 64
}

/// The control words in the shared control segment.
pub(super) struct Ctrl {
    pub(super) seg: Arc<Segment>,
}

impl Ctrl {
    pub(super) fn new(seg: Arc<Segment>, slots: u32) -> Result<Ctrl> {
        if seg.len() < ctrl_bytes(slots) {
            return Err(Error::Protocol(format!(
                "GPU ring control segment of {} bytes, {} needed for {slots} slots",
                seg.len(),
                ctrl_bytes(slots)
            )));
        }
        Ok(Ctrl { seg })
    }

    pub(super) fn credits(&self, slots: u32) -> Credits<'_> {
        // SAFETY: FREED_AT + 8 and BELL_AT + 8 ≤ HANDLES_AT ≤ len (checked in `new`),
        // 8-aligned offsets in a page-aligned mapping; the words are only accessed
        // atomically (a hostile peer writing them can only make waits time out or be
        // reported as corrupt, see `credits`).
        unsafe {
            let base = self.seg.as_ptr();
            Credits::new(&*base.add(FREED_AT).cast::<AtomicU64>(), &*base.add(BELL_AT).cast::<DoorbellWords>(), slots as u64)
        }
    }

    pub(super) fn state(&self) -> &AtomicU32 {
        // SAFETY: STATE_AT + 4 ≤ len (checked in `new`), aligned; accessed atomically only.
        unsafe { &*self.seg.as_ptr().add(STATE_AT).cast::<AtomicU32>() }
    }

    /// The consumer's `MODE_*` word (valid once its state is READY or later).
    pub(super) fn mode(&self) -> &AtomicU32 {
        // SAFETY: MODE_AT + 4 ≤ HANDLES_AT ≤ len (checked in `new`), aligned; accessed
        // atomically only.
        unsafe { &*self.seg.as_ptr().add(MODE_AT).cast::<AtomicU32>() }
    }
}

/// One chunk record, parsed from private memory.
#[derive(Debug, Clone, Copy)]
pub(super) struct Chunk {
    pub(super) flags: u32,
    pub(super) seq: u64,
    pub(super) offset: u64,
    pub(super) len: u64,
    pub(super) total: u64,
}

impl Chunk {
    pub(super) fn encode(&self, desc: Option<&TensorDesc>) -> Vec<u8> {
        let mut r = vec![0u8; REC_HEADER];
        r[0..4].copy_from_slice(&REC_MAGIC.to_le_bytes());
        r[4..8].copy_from_slice(&self.flags.to_le_bytes());
        r[8..16].copy_from_slice(&self.seq.to_le_bytes());
        r[16..24].copy_from_slice(&self.offset.to_le_bytes());
        r[24..32].copy_from_slice(&self.len.to_le_bytes());
        r[32..40].copy_from_slice(&self.total.to_le_bytes());
        if let Some(d) = desc {
            r.extend_from_slice(d.encode());
        }
        r
    }

    pub(super) fn decode(r: &[u8]) -> Result<(Chunk, Option<TensorDesc>)> {
        let bad = |m: String| Error::Protocol(format!("GPU ring record: {m}"));
        if r.len() != REC_HEADER && r.len() != REC_HEADER + DESC_SIZE {
            return Err(bad(format!("{} bytes, expected {REC_HEADER} or {}", r.len(), REC_HEADER + DESC_SIZE)));
        }
        let u32_at = |o: usize| u32::from_le_bytes(r[o..o + 4].try_into().expect("4 bytes"));
        let u64_at = |o: usize| u64::from_le_bytes(r[o..o + 8].try_into().expect("8 bytes"));
        if u32_at(0) != REC_MAGIC {
            return Err(bad(format!("bad magic {:#010x}", u32_at(0))));
        }
        let c = Chunk { flags: u32_at(4), seq: u64_at(8), offset: u64_at(16), len: u64_at(24), total: u64_at(32) };
        if c.flags & !(FLAG_FIRST | FLAG_LAST) != 0 || r[40..REC_HEADER].iter().any(|&b| b != 0) {
            return Err(bad(format!("unknown flags {:#x} or non-zero reserved bytes", c.flags)));
        }
        let first = c.flags & FLAG_FIRST != 0;
        if first != (r.len() > REC_HEADER) {
            return Err(bad("a first chunk must carry the descriptor, and only a first chunk".into()));
        }
        let desc = if first { Some(TensorDesc::decode(&r[REC_HEADER..])?) } else { None };
        Ok((c, desc))
    }
}

pub(super) fn credit_err(e: CreditError, deadline: &mut Deadline) -> Error {
    match e {
        CreditError::Corrupt { freed, issued } => Error::Protocol(format!(
            "GPU ring broken: the consumer claims {freed} chunks freed, only {issued} were sent"
        )),
        CreditError::Timeout => deadline.timed_out("the consumer to free a GPU ring slot"),
        CreditError::Gone => Error::peer_gone("the consumer went away while the GPU ring was full"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::ring::test_support::*;

    #[test]
    fn records_round_trip() {
        let (c, d) = first(10_000, 4096);
        let (c2, d2) = Chunk::decode(&c.encode(Some(&d))).unwrap();
        assert_eq!((c2.flags, c2.seq, c2.offset, c2.len, c2.total), (c.flags, 0, 0, 4096, 10_000));
        assert_eq!(d2.unwrap(), d);
        let mut r = c.encode(None);
        {
        let e = Chunk::decode(&r).unwrap_err();
        assert!(matches!(e, Error::Protocol(_)) && e.to_string().contains("must carry the descriptor"), "{e}");
    }
        r[0] ^= 1;
        {
        let e = Chunk::decode(&r).unwrap_err();
        assert!(matches!(e, Error::Protocol(_)) && e.to_string().contains("bad magic"), "{e}");
    }
        let mut r = c.encode(Some(&d));
        r[50] = 1;
        {
        let e = Chunk::decode(&r).unwrap_err();
        assert!(matches!(e, Error::Protocol(_)) && e.to_string().contains("reserved"), "{e}");
    }
        {
        let e = Chunk::decode(&[0; 100]).unwrap_err();
        assert!(matches!(e, Error::Protocol(_)) && e.to_string().contains("100 bytes"), "{e}");
    }
    }
}
