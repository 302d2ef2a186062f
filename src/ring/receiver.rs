//! The receiving half of a ring: records validated and turned into messages (a chunked
//! message reassembled into one buffer, a single record copied out or borrowed in place),
//! ring space released in ring order as messages are done with it.

use super::message::{BorrowToken, Data, Release, RingMessage};
use super::shared::{MmapRegion, RingShared};
use super::spsc::{Consumer, Record, RingBroken, Watch, FLAG_FIRST, FLAG_LAST};
use crate::waiting::waiter::Waiter;
use crate::desc::{StorageKind, TensorDesc, DESC_SIZE};
use crate::doorbell::Doorbell;
use crate::error::{Error, Result};
use crate::segment::Segment;
use crate::waiting::spin_policy::SpinPolicy;
use crate::wait::{Deadline, Wait};
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::sync::Arc;

/// What a receive waits for, and what it means that the producer went away meanwhile.
const RECV_WAITS_FOR: &str = "a message in the ring";
const RECV_GONE: &str = "the producer went away with nothing left in the ring";

impl Release for Mutex<RecvState> {
    fn release(&self, end: u64) {
        self.lock().finish(end);
    }
}

struct Assembly {
    tag: u64,
    desc: Option<TensorDesc>,
    total: u64,
    buf: Vec<u8>,
}

struct RecvState {
    consumer: Consumer<'static, MmapRegion>,
    /// Records read but not yet released, in ring order: (end, finished).
    pending: VecDeque<(u64, bool)>,
    assembly: Option<Assembly>,
    max_message: u64,
    /// Address of the data area (for borrows), as an integer.
    region_base: usize,
    /// A caller's buffer lent to the next reassembly (`recv_into`).
    spare: Vec<u8>,
    broken: Option<RingBroken>,
    // Declared last: keeps the mapping the consumer's references point into alive.
    _shared: RingShared,
}

impl RecvState {
    /// Mark the record ending at `end` finished and release the finished prefix.
    fn finish(&mut self, end: u64) {
        if let Some(e) = self.pending.iter_mut().find(|(e, _)| *e == end) {
            e.1 = true;
        }
        let mut upto = None;
        while let Some(&(e, true)) = self.pending.front() {
            upto = Some(e);
            self.pending.pop_front();
        }
        if let Some(e) = upto {
            self.consumer.release_to(e);
        }
    }

    fn broken(&mut self, why: RingBroken) -> Error {
        self.broken.get_or_insert(why);
        Error::RingBroken(why)
    }


    fn decode_desc(&mut self, rec: &Record) -> Result<Option<TensorDesc>> {
        let mut out = None;
        self.decode_desc_into(rec, &mut out)?;
        Ok(out)
    }

    /// Validate `rec`'s meta as a ring tensor descriptor into `out` (left `None` for a
    /// bytes message). Writes in place: descriptors are 400 bytes.
    fn decode_desc_into(&mut self, rec: &Record, out: &mut Option<TensorDesc>) -> Result<()> {
        *out = None;
        let len = rec.header.meta_len as usize;
        if len == 0 {
            return Ok(());
        }
        if len != DESC_SIZE {
            return Err(self.broken(RingBroken::MetaNotDescriptor { len }));
        }
        let mut raw = [0u8; DESC_SIZE];
        self.consumer.read_meta(rec, &mut raw);
        let d = TensorDesc::decode(&raw)?;
        if d.kind() != Some(StorageKind::RingSlot) || d.storage.nbytes != rec.header.total_len || d.storage.base_offset != 0 {
            return Err(Error::InvalidDescriptor(format!(
                "ring descriptor must name a RingSlot of {} bytes at offset 0",
                rec.header.total_len
            )));
        }
        if !d.layout().is_contiguous() || d.layout().storage_offset != 0 || d.layout().packed_bytes() != d.storage.nbytes {
            return Err(Error::InvalidDescriptor("ring descriptor must describe the packed contiguous data".into()));
        }
        *out = Some(d);
        Ok(())
    }

    /// Turn the next record into a message if it completes one. `borrow`: leave a
    /// single-record message in place.
    fn process(&mut self, rec: Record, borrow: bool, me: Option<&Arc<Mutex<RecvState>>>) -> Result<Option<RingMessage>> {
        let h = rec.header;
        let first = h.flags & FLAG_FIRST != 0;
        let last = h.flags & FLAG_LAST != 0;
        self.pending.push_back((rec.end, false));
        let out = (|| {
            if first {
                if self.assembly.is_some() {
                    return Err(self.broken(RingBroken::MessageInsideChunked));
                }
                if h.total_len > self.max_message {
                    return Err(Error::QuotaExceeded(format!(
                        "ring message of {} bytes exceeds the {}-byte limit",
                        h.total_len, self.max_message
                    )));
                }
                if h.data_len > h.total_len || (last && h.data_len != h.total_len) {
                    return Err(self.broken(RingBroken::ChunkLargerThanMessage { chunk: h.data_len, total: h.total_len }));
                }
                let desc = self.decode_desc(&rec)?;
                if let (true, true, Some(me)) = (last, borrow, me) {
                    // SAFETY: data_offset + data_len lies inside the validated record;
                    // the token keeps it unreleased.
                    let ptr = unsafe { self.consumer_base().add(rec.data_offset as usize) };
                    let token = BorrowToken { to: Some(me.clone() as Arc<dyn Release>), end: rec.end };
                    return Ok(Some(RingMessage { tag: h.tag, desc, data: Data::Borrowed { ptr, len: h.data_len as usize, _token: token } }));
                }
                let mut buf = std::mem::take(&mut self.spare);
                buf.clear();
                let reserve = if last { h.total_len } else { h.total_len.min(1 << 26) };
                buf.try_reserve(reserve as usize)
                    .map_err(|_| Error::InvalidArgument(format!("cannot allocate {reserve} bytes")))?;
                self.assembly = Some(Assembly { tag: h.tag, desc, total: h.total_len, buf });
            } else if self.assembly.is_none() {
                return Err(self.broken(RingBroken::ContinuationWithoutStart));
            }
            let a = self.assembly.as_mut().expect("set above");
            if a.buf.len() as u64 + h.data_len > a.total {
                let total = a.total;
                return Err(self.broken(RingBroken::ChunksExceedTotal { total }));
            }
            let n = h.data_len;
            self.consumer
                .append_data(&rec, &mut a.buf)
                .map_err(|_| Error::InvalidArgument(format!("cannot allocate {n} more bytes for a ring message")))?;
            if last {
                let a = self.assembly.take().expect("set above");
                if a.buf.len() as u64 != a.total {
                    return Err(self.broken(RingBroken::MessageCutShort { got: a.buf.len() as u64, total: a.total }));
                }
                return Ok(Some(RingMessage { tag: a.tag, desc: a.desc, data: Data::Owned(a.buf) }));
            }
            Ok(None)
        })();
        // Everything but a live borrow is finished with its ring bytes now.
        if !matches!(&out, Ok(Some(m)) if m.is_borrowed()) {
            self.finish(rec.end);
        }
        if out.is_err() {
            self.assembly = None;
        }
        out
    }

    fn consumer_base(&self) -> *const u8 {
        self.region_base as *const u8
    }

    /// The next record, or an error that leaves the ring broken for good.
    #[inline]
    fn next_record(&mut self) -> Result<Option<Record>> {
        if let Some(why) = self.broken {
            return Err(Error::RingBroken(why));
        }
        // A record the consumer refused breaks it for good: it repeats that reason on
        // every later pop. `self.broken` holds the other kind: valid records that make
        // no valid message.
        Ok(self.consumer.try_pop()?)
    }

    /// Like `poll`, but the message's bytes land in `buf` (reusing its capacity): a
    /// single-record message is copied straight from the ring and released at once (no
    /// message object); a chunked one is reassembled into `buf`'s allocation.
    fn poll_into(&mut self, buf: &mut Vec<u8>, desc: &mut Option<TensorDesc>) -> Result<Option<u64>> {
        loop {
            let Some(rec) = self.next_record()? else { return Ok(None) };
            let h = rec.header;
            if h.flags == FLAG_FIRST | FLAG_LAST && self.assembly.is_none() && h.data_len == h.total_len && h.total_len <= self.max_message {
                let r = self.decode_desc_into(&rec, desc).and_then(|()| {
                    buf.clear();
                    let n = h.data_len;
                    self.consumer
                        .append_data(&rec, buf)
                        .map_err(|_| Error::InvalidArgument(format!("cannot allocate {n} bytes for a ring message")))?;
                    Ok(Some(h.tag))
                });
                if self.pending.is_empty() {
                    // Nothing older is held: release at once (no bookkeeping).
                    self.consumer.release_to(rec.end);
                } else {
                    self.pending.push_back((rec.end, false));
                    self.finish(rec.end);
                }
                return r;
            }
            // Anything else (chunks, or a single record the checks above would refuse):
            // the general path, reassembling into `buf`'s allocation.
            self.spare = std::mem::take(buf);
            let r = self.process(rec, false, None);
            *buf = std::mem::take(&mut self.spare);
            match r? {
                Some(m) => {
                    *desc = m.desc;
                    if let Data::Owned(v) = m.data {
                        *buf = v;
                    }
                    return Ok(Some(m.tag));
                }
                None => continue,
            }
        }
    }

    /// The stamp of the next record, to wait for without the lock.
    fn watch(&self) -> Watch<MmapRegion> {
        self.consumer.watch()
    }

    /// Pop and process records until a message completes or none is published.
    fn poll(&mut self, borrow: bool, me: &Arc<Mutex<RecvState>>) -> Result<Option<RingMessage>> {
        loop {
            let Some(rec) = self.next_record()? else { return Ok(None) };
            if let Some(m) = self.process(rec, borrow, Some(me))? {
                return Ok(Some(m));
            }
        }
    }
}

/// The receiving half of a ring. Messages may be received from one thread at a time;
/// borrowed messages may be dropped on any thread.
pub struct RingReceiver {
    state: Arc<Mutex<RecvState>>,
    data_bell: Doorbell<'static>,
    /// Whether a receive may spin now (not while the producer shares our core).
    spin_policy: SpinPolicy,
    // Keeps the mapping `data_bell` points into alive.
    _seg: Arc<Segment>,
}

impl RingReceiver {
    /// `max_message`: largest reassembled message accepted (bounds memory a hostile
    /// producer can make us allocate).
    pub fn new(shared: RingShared, max_message: u64) -> RingReceiver {
        let (ctrl, region) = shared.parts();
        let region_base = region.base as usize;
        let seg = shared.segment().clone();
        let state = RecvState {
            consumer: Consumer::new(ctrl, region),
            pending: VecDeque::new(),
            assembly: None,
            max_message,
            region_base,
            spare: Vec::new(),
            broken: None,
            _shared: shared,
        };
        RingReceiver { state: Arc::new(Mutex::new(state)), data_bell: ctrl.data_bell, spin_policy: SpinPolicy::default(), _seg: seg }
    }

    /// Receive one message: a copy (`borrow` false), or, for a message that fits one
    /// record, the bytes in place until the message is dropped (`borrow` true).
    /// Waits as `wait` says; `spin` polls come before each sleep.
    pub fn recv(&self, borrow: bool, wait: impl Into<Wait>, spin: u32, gone: &dyn Fn() -> bool) -> Result<RingMessage> {
        let mut deadline = wait.into().deadline();
        let mut waiter = Waiter::new(self.data_bell, spin, &self.spin_policy, &mut deadline, RECV_WAITS_FOR, RECV_GONE);
        loop {
            let watch = {
                let mut st = self.state.lock();
                if let Some(m) = st.poll(borrow, &self.state)? {
                    return Ok(m);
                }
                st.watch()
            };
            waiter.wait(&|| watch.ready(), gone)?;
        }
    }

    /// Receive one message into `buf` (replacing its contents, reusing its capacity —
    /// also for messages reassembled from chunks). Returns the tag and descriptor.
    pub fn recv_into(&self, buf: &mut Vec<u8>, wait: impl Into<Wait>, spin: u32, gone: &dyn Fn() -> bool) -> Result<(u64, Option<TensorDesc>)> {
        self.recv_into_until(buf, &mut wait.into().deadline(), spin, gone)
    }

    /// `recv_into` within a caller's deadline (one clock for a larger wait).
    pub(crate) fn recv_into_until(
        &self,
        buf: &mut Vec<u8>,
        deadline: &mut Deadline,
        spin: u32,
        gone: &dyn Fn() -> bool,
    ) -> Result<(u64, Option<TensorDesc>)> {
        let mut waiter = Waiter::new(self.data_bell, spin, &self.spin_policy, deadline, RECV_WAITS_FOR, RECV_GONE);
        let mut desc = None;
        loop {
            // Nothing published: wait for the next record's stamp with the lock dropped
            // (a borrowed message may be dropped meanwhile, on any thread). The watch is
            // a hint: the next poll validates whatever it finds.
            let watch = {
                let mut st = self.state.lock();
                if let Some(tag) = st.poll_into(buf, &mut desc)? {
                    return Ok((tag, desc));
                }
                st.watch()
            };
            waiter.wait(&|| watch.ready(), gone)?;
        }
    }

    /// Receive up to `max` messages: wait for the first, then take whatever else is
    /// already published (one wake-up for a batch).
    pub fn recv_many(&self, max: usize, borrow: bool, wait: impl Into<Wait>, spin: u32, gone: &dyn Fn() -> bool) -> Result<Vec<RingMessage>> {
        let mut out = vec![self.recv(borrow, wait, spin, gone)?];
        let mut st = self.state.lock();
        while out.len() < max {
            match st.poll(borrow, &self.state)? {
                Some(m) => out.push(m),
                None => break,
            }
        }
        Ok(out)
    }
}
