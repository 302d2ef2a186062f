//! Rings over mapped memfd segments (see the module docs in `ring/mod.rs`).


use crate::desc::{Layout, PackCursor, StorageKind, TensorDesc, DESC_SIZE};
use crate::doorbell::{Doorbell, DoorbellWords};
use crate::error::{Error, Result};
use crate::segment::Segment;
use bytemuck::Zeroable;
use parking_lot::Mutex;
use super::spsc::{Consumer, Ctrl, Producer, Record, Region, RingError, FLAG_FIRST, FLAG_LAST};
use std::collections::VecDeque;
use std::marker::PhantomData;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use crate::wait::{Deadline, Wait};
use std::time::Duration;

const RING_MAGIC: u64 = u64::from_le_bytes(*b"TWRING01");
const RING_VERSION: u32 = 1;
// The producer writes one cache line (head + the data doorbell it rings), the consumer
// another (tail + the space doorbell it rings): a message costs the consumer one line
// transfer to see it, and the producer reads the consumer's line only when short of space.
const OFF_HEAD: usize = 64;
const OFF_DATA_BELL: usize = 72;
const OFF_TAIL: usize = 128;
const OFF_SPACE_BELL: usize = 136;
/// Offset of the data area in the ring segment.
pub const DATA_OFFSET: usize = 4096;
/// Smallest and largest data area.
pub const MIN_RING_BYTES: usize = 4096;
pub const MAX_RING_BYTES: usize = 1 << 34;
/// Largest data part of a record of a chunked message (one larger than a record). Small
/// enough that copy-in and copy-out overlap (many chunks in flight, each handed over
/// within the waiting side's spin budget), large enough that per-chunk costs vanish.
const CHUNK_BYTES: u64 = 1 << 20;
/// How long one sleep lasts before the peer's liveness is checked again.
const LIVENESS_SLICE: Duration = Duration::from_millis(50);

/// The data area of a mapped ring segment.
struct MmapRegion {
    base: *mut u8,
    cap: u64,
}

// SAFETY: the region is a raw view of a shared mapping that the owning `RingShared` keeps
// alive; moving it between threads is fine (all access is by explicit copies).
unsafe impl Send for MmapRegion {}

impl Region for MmapRegion {
    fn capacity(&self) -> u64 {
        self.cap
    }
    unsafe fn write_with(&self, at: u64, len: usize, fill: &mut dyn FnMut(&mut [u8])) {
        // SAFETY: the caller guarantees [at, at+len) is inside the data area and that the
        // consumer does not read it now; the mapping outlives `self`.
        fill(unsafe { std::slice::from_raw_parts_mut(self.base.add(at as usize), len) })
    }
    unsafe fn read(&self, at: u64, dst: &mut [u8]) {
        // SAFETY: the caller guarantees the range is inside the data area and published.
        unsafe { std::ptr::copy_nonoverlapping(self.base.add(at as usize), dst.as_mut_ptr(), dst.len()) }
    }
    fn prefetch(&self, at: u64, len: u64) {
        #[cfg(target_arch = "x86_64")]
        {
            let mut off = at & !63;
            while off < at + len {
                // SAFETY: a prefetch never faults or changes memory; the address is inside
                // the mapped data area anyway (at + len ≤ capacity).
                unsafe {
                    std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(self.base.add(off as usize).cast())
                };
                off += 64;
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (at, len);
    }
    fn prefetch_write(&self, at: u64, len: u64) {
        #[cfg(target_arch = "x86_64")]
        {
            let mut off = at & !63;
            while off < at + len {
                // SAFETY: PREFETCHW never faults or changes memory (it executes as a NOP
                // on CPUs without it); the address is inside the mapped data area anyway.
                unsafe {
                    std::arch::asm!("prefetchw [{p}]", p = in(reg) self.base.add(off as usize), options(nostack, preserves_flags, readonly))
                };
                off += 64;
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (at, len);
    }
    unsafe fn read_raw(&self, at: u64, dst: *mut u8, len: usize) {
        // SAFETY: as for `read`; the caller guarantees `dst` is writable for `len` bytes.
        unsafe { std::ptr::copy_nonoverlapping(self.base.add(at as usize), dst, len) }
    }
}

/// Largest peer ring whose pages are mapped in advance when opened.
const POPULATE_PEER_MAX: u64 = 64 << 20;

/// Fault in a whole ring segment now (`MADV_POPULATE_WRITE` / `_READ`, Linux 5.14+). Only
/// an optimisation: on an older kernel, or on failure, pages fault in on first use.
fn populate(seg: &Segment, advice: libc::c_int) {
    // SAFETY: the range is exactly the live mapping of `seg`; populating it only faults
    // pages in (no change to contents or protections).
    unsafe { libc::madvise(seg.as_ptr().cast(), seg.len(), advice) };
}

/// A ring segment, mapped, with its capacity validated.
pub struct RingShared {
    seg: Arc<Segment>,
    cap: u64,
}

impl RingShared {
    /// Create a ring with a data area of `bytes` (a power of two, 4 KiB ..= 16 GiB).
    pub fn create(bytes: usize) -> Result<RingShared> {
        if !bytes.is_power_of_two() || !(MIN_RING_BYTES..=MAX_RING_BYTES).contains(&bytes) {
            return Err(Error::InvalidArgument(format!(
                "ring size {bytes} must be a power of two in {MIN_RING_BYTES}..={MAX_RING_BYTES}"
            )));
        }
        let seg = Segment::create(DATA_OFFSET + bytes)?;
        let mut hdr = [0u8; 24];
        hdr[0..8].copy_from_slice(&RING_MAGIC.to_le_bytes());
        hdr[8..12].copy_from_slice(&RING_VERSION.to_le_bytes());
        hdr[16..24].copy_from_slice(&(bytes as u64).to_le_bytes());
        seg.write_at(0, &hdr)?;
        // The ring is registered once and reused for every message: allocate and map all
        // of it now rather than in page faults during the first lap of messages.
        populate(&seg, libc::MADV_POPULATE_WRITE);
        Ok(RingShared { seg: Arc::new(seg), cap: bytes as u64 })
    }

    /// Validate a ring segment from the peer. `claimed` is the size its setup message
    /// announced; the header must agree and the segment must hold the whole area.
    pub fn open(fd: std::os::fd::OwnedFd, claimed: u64, max_bytes: usize) -> Result<RingShared> {
        if !claimed.is_power_of_two() || claimed < MIN_RING_BYTES as u64 || claimed > max_bytes as u64 {
            return Err(Error::Protocol(format!(
                "peer's ring of {claimed} bytes is not a power of two in {MIN_RING_BYTES}..={max_bytes}"
            )));
        }
        let seg = Segment::from_fd_exact(fd, DATA_OFFSET + claimed as usize, "the peer's ring segment")?;
        let mut hdr = [0u8; 24];
        seg.read_at(0, &mut hdr)?;
        let magic = u64::from_le_bytes(hdr[0..8].try_into().unwrap());
        let version = u32::from_le_bytes(hdr[8..12].try_into().unwrap());
        let cap = u64::from_le_bytes(hdr[16..24].try_into().unwrap());
        if magic != RING_MAGIC || version != RING_VERSION || cap != claimed {
            return Err(Error::Protocol(format!(
                "ring header invalid (magic {magic:#x}, version {version}, capacity {cap}, claimed {claimed})"
            )));
        }
        // Map the pages the producer allocated (read faults only; bounded, since the size
        // is the peer's choice: beyond it pages are mapped on first use as before).
        if claimed <= POPULATE_PEER_MAX {
            populate(&seg, libc::MADV_POPULATE_READ);
        }
        Ok(RingShared { seg: Arc::new(seg), cap })
    }

    pub fn segment(&self) -> &Arc<Segment> {
        &self.seg
    }
    pub fn capacity(&self) -> u64 {
        self.cap
    }

    /// The control words and the data area. `'static` because the segment is kept
    /// alive by the `Arc` that every user of these also holds (see `RingSender`).
    fn parts(&self) -> (Ctrl<'static>, MmapRegion) {
        let base = self.seg.as_ptr();
        // SAFETY: every offset is inside the first 4096 bytes of a mapping of at least
        // DATA_OFFSET + cap bytes (checked at create/open), 8-aligned, and these words are
        // only ever accessed atomically. The 'static lifetime is sound because each
        // holder of the returned references also holds `self.seg` (declared after the
        // user of the references, so it is dropped later).
        unsafe {
            let word = |off: usize| &*base.add(off).cast::<AtomicU64>();
            let bell = |off: usize| Doorbell::new(&*base.add(off).cast::<DoorbellWords>());
            let ctrl = Ctrl {
                head: word(OFF_HEAD),
                tail: word(OFF_TAIL),
                data_bell: bell(OFF_DATA_BELL),
                space_bell: bell(OFF_SPACE_BELL),
            };
            (ctrl, MmapRegion { base: base.add(DATA_OFFSET), cap: self.cap })
        }
    }
}

fn ring_err(e: RingError) -> Error {
    match e {
        RingError::Broken(m) => Error::Protocol(format!("ring broken: {m}")),
        RingError::TooLarge { size, max } => {
            Error::InvalidArgument(format!("record of {size} bytes exceeds the ring's {max}-byte record limit"))
        }
    }
}

/// What to send: bytes, or a tensor view over some storage.
pub struct RingItem<'a> {
    tag: u64,
    payload: Payload<'a>,
}

#[allow(clippy::large_enum_variant)] // short-lived, on the stack, one per send
enum Payload<'a> {
    Bytes(&'a [u8]),
    Tensor { layout: Layout, base: *const u8, _storage: PhantomData<&'a [u8]> },
}

impl<'a> RingItem<'a> {
    pub fn bytes(tag: u64, data: &'a [u8]) -> Self {
        RingItem { tag, payload: Payload::Bytes(data) }
    }

    /// A view `layout` over private `storage` (the view must fit inside it).
    pub fn tensor(tag: u64, layout: Layout, storage: &'a [u8]) -> Result<Self> {
        let need = layout.extent_bytes()?;
        if need > storage.len() as u64 {
            return Err(Error::InvalidArgument(format!("view needs {need} bytes of storage, storage has {}", storage.len())));
        }
        Ok(RingItem { tag, payload: Payload::Tensor { layout, base: storage.as_ptr(), _storage: PhantomData } })
    }

    /// A view of a shared tensor.
    pub fn shared(tag: u64, t: &'a crate::shared_tensor::SharedTensor) -> Self {
        RingItem { tag, payload: Payload::Tensor { layout: *t.layout(), base: t.storage_ptr(), _storage: PhantomData } }
    }

    fn len(&self) -> u64 {
        match &self.payload {
            Payload::Bytes(b) => b.len() as u64,
            Payload::Tensor { layout, .. } => layout.packed_bytes(),
        }
    }
}

/// The sending half of a ring.
pub struct RingSender {
    producer: Producer<'static, MmapRegion>,
    // Declared after `producer`: keeps the mapping its references point into alive.
    shared: RingShared,
}

impl RingSender {
    pub fn new(shared: RingShared) -> RingSender {
        let (ctrl, region) = shared.parts();
        RingSender { producer: Producer::new(ctrl, region), shared }
    }

    pub fn capacity(&self) -> u64 {
        self.shared.cap
    }

    /// Send all `items` (one publish and at most one wake-up for the batch, unless the
    /// ring fills and the consumer must drain part of it first). `gone` is polled while
    /// waiting for space, which lasts as `wait` says; `spin` polls come before each sleep.
    pub fn send_many(&mut self, items: &[RingItem<'_>], wait: impl Into<Wait>, spin: u32, gone: &dyn Fn() -> bool) -> Result<()> {
        self.send_many_until(items, &mut wait.into().deadline(), spin, gone)
    }

    /// `send_many` within a caller's deadline (one clock for a larger wait).
    pub(crate) fn send_many_until(&mut self, items: &[RingItem<'_>], deadline: &mut Deadline, spin: u32, gone: &dyn Fn() -> bool) -> Result<()> {
        for item in items {
            let total = item.len();
            let desc = match &item.payload {
                Payload::Bytes(_) => None,
                Payload::Tensor { layout, .. } => {
                    let packed = Layout::contiguous(layout.dtype, layout.sizes())?;
                    let storage = crate::desc::StorageRef { nbytes: total, ..Zeroable::zeroed() };
                    Some(TensorDesc::new(&packed, StorageKind::RingSlot, storage))
                }
            };
            let mut cursor = match &item.payload {
                Payload::Tensor { layout, .. } => Some(PackCursor::new(layout)),
                Payload::Bytes(_) => None,
            };
            let mut sent: u64 = 0;
            let mut first = true;
            loop {
                let meta: &[u8] = match (&desc, first) {
                    (Some(d), true) => d.encode(),
                    _ => &[],
                };
                // A message that fits one record goes as one (so it can be borrowed);
                // a larger one in chunks of at most CHUNK_BYTES, so that the consumer
                // copies one chunk out while we copy the next in.
                let max = self.producer.max_data(meta.len() as u32) & !63;
                let max = if first && total <= max { max } else { max.min(CHUNK_BYTES) };
                let chunk = (total - sent).min(max);
                let last = sent + chunk == total;
                let flags = if first { FLAG_FIRST } else { 0 } | if last { FLAG_LAST } else { 0 };
                let payload = &item.payload;
                let mut fill = |dst: &mut [u8]| match payload {
                    Payload::Bytes(b) => dst.copy_from_slice(&b[sent as usize..sent as usize + dst.len()]),
                    Payload::Tensor { base, .. } => {
                        let c = cursor.as_mut().expect("tensor items have a cursor");
                        // SAFETY: `base` is valid for the view's extent (checked when the
                        // item was built, and the borrow `'a` keeps it alive).
                        let n = unsafe { c.fill(*base, dst) };
                        debug_assert_eq!(n, dst.len());
                    }
                };
                loop {
                    if self.producer.try_push(flags, item.tag, total, meta, chunk, &mut fill).map_err(ring_err)? {
                        break;
                    }
                    // Full: let the consumer see what we have, then wait for space — spin
                    // first, then (with the clock and a liveness check) sleep. The space
                    // doorbell lives on the consumer's cache line: read it only here, when
                    // short of space, never on the fast path (that would pull the line over
                    // once per message). Read it before trying again, so a release between
                    // the failed try and the read is not missed.
                    self.producer.publish();
                    let bell = self.producer.doorbells().space_bell;
                    let seen = bell.current();
                    if self.producer.try_push(flags, item.tag, total, meta, chunk, &mut fill).map_err(ring_err)? {
                        break;
                    }
                    if bell.spin(seen, deadline.spins(spin)) {
                        continue;
                    }
                    let Some(nap) = deadline.slice(LIVENESS_SLICE) else {
                        return Err(deadline.timed_out("space in the ring (the consumer is not draining it)"));
                    };
                    if gone() {
                        return Err(Error::peer_gone("the consumer went away while the ring was full"));
                    }
                    bell.wait(seen, 0, nap);
                }
                sent += chunk;
                first = false;
                if last {
                    break;
                }
            }
        }
        self.producer.publish();
        Ok(())
    }
}

/// How a received message's bytes are held.
enum Data {
    Owned(Vec<u8>),
    Borrowed { ptr: *const u8, len: usize, _token: BorrowToken },
}

// SAFETY: a borrowed message points into the ring mapping, which its token keeps alive;
// the bytes are only read through explicit copies or by the holder.
unsafe impl Send for Data {}

/// One received message.
pub struct RingMessage {
    pub tag: u64,
    /// For tensors: the (contiguous) layout, storage kind `RingSlot`, nbytes = data length.
    pub desc: Option<TensorDesc>,
    data: Data,
}

impl std::fmt::Debug for RingMessage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RingMessage")
            .field("tag", &self.tag)
            .field("tensor", &self.desc.map(|d| d.layout()))
            .field("len", &self.len())
            .field("borrowed", &self.is_borrowed())
            .finish()
    }
}

impl RingMessage {
    pub fn len(&self) -> usize {
        match &self.data {
            Data::Owned(v) => v.len(),
            Data::Borrowed { len, .. } => *len,
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// True if the bytes are still in the ring (released when this is dropped).
    pub fn is_borrowed(&self) -> bool {
        matches!(self.data, Data::Borrowed { .. })
    }
    /// Address of the bytes (in the ring for a borrowed message; the producer side may
    /// be hostile and scribble them, so copy before trusting).
    pub fn as_ptr(&self) -> *const u8 {
        match &self.data {
            Data::Owned(v) => v.as_ptr(),
            Data::Borrowed { ptr, .. } => *ptr,
        }
    }
    /// The bytes, copied to (or already in) private memory.
    pub fn into_vec(self) -> Vec<u8> {
        match self.data {
            Data::Owned(v) => v,
            Data::Borrowed { ptr, len, .. } => {
                let mut v = vec![0u8; len];
                // SAFETY: the token (dropped after this copy) keeps [ptr, ptr+len) in the
                // ring unreleased and mapped.
                unsafe { std::ptr::copy_nonoverlapping(ptr, v.as_mut_ptr(), len) };
                v
            }
        }
    }
    /// The bytes of an owned message.
    pub fn owned(&self) -> Option<&[u8]> {
        match &self.data {
            Data::Owned(v) => Some(v),
            Data::Borrowed { .. } => None,
        }
    }
}

/// Keeps a borrowed region unreleased; dropping it releases in ring order.
struct BorrowToken {
    /// `None` once disarmed by a caller that finished the record itself.
    state: Option<Arc<Mutex<RecvState>>>,
    end: u64,
}

impl Drop for BorrowToken {
    fn drop(&mut self) {
        if let Some(s) = self.state.take() {
            s.lock().finish(self.end);
        }
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
    broken: Option<String>,
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

    fn broken(&mut self, m: String) -> Error {
        self.broken.get_or_insert(m.clone());
        Error::Protocol(format!("ring broken: {m}"))
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
        if rec.meta.is_empty() {
            return Ok(());
        }
        if rec.meta.len() != DESC_SIZE {
            return Err(self.broken(format!("meta of {} bytes is not a descriptor", rec.meta.len())));
        }
        let d = TensorDesc::decode(&rec.meta)?;
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
                    return Err(self.broken("a new message started inside a chunked one".into()));
                }
                if h.total_len > self.max_message {
                    return Err(Error::QuotaExceeded(format!(
                        "ring message of {} bytes exceeds the {}-byte limit",
                        h.total_len, self.max_message
                    )));
                }
                if h.data_len > h.total_len || (last && h.data_len != h.total_len) {
                    return Err(self.broken(format!("chunk of {} bytes for a message of {}", h.data_len, h.total_len)));
                }
                let desc = self.decode_desc(&rec)?;
                if let (true, true, Some(me)) = (last, borrow, me) {
                    // SAFETY: data_offset + data_len lies inside the validated record;
                    // the token keeps it unreleased.
                    let ptr = unsafe { self.consumer_base().add(rec.data_offset as usize) };
                    let token = BorrowToken { state: Some(me.clone()), end: rec.end };
                    return Ok(Some(RingMessage { tag: h.tag, desc, data: Data::Borrowed { ptr, len: h.data_len as usize, _token: token } }));
                }
                let mut buf = std::mem::take(&mut self.spare);
                buf.clear();
                let reserve = if last { h.total_len } else { h.total_len.min(1 << 26) };
                buf.try_reserve(reserve as usize)
                    .map_err(|_| Error::InvalidArgument(format!("cannot allocate {reserve} bytes")))?;
                self.assembly = Some(Assembly { tag: h.tag, desc, total: h.total_len, buf });
            } else if self.assembly.is_none() {
                return Err(self.broken("a continuation chunk arrived with no message started".into()));
            }
            let a = self.assembly.as_mut().expect("set above");
            if a.buf.len() as u64 + h.data_len > a.total {
                let m = format!("chunks exceed the announced {} bytes", a.total);
                return Err(self.broken(m));
            }
            let n = h.data_len;
            self.consumer
                .append_data(&rec, &mut a.buf)
                .map_err(|_| Error::InvalidArgument(format!("cannot allocate {n} more bytes for a ring message")))?;
            if last {
                let a = self.assembly.take().expect("set above");
                if a.buf.len() as u64 != a.total {
                    return Err(self.broken(format!("message ended at {} of {} bytes", a.buf.len(), a.total)));
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
    fn next_record(&mut self) -> Result<Option<Record>> {
        if let Some(m) = &self.broken {
            return Err(Error::Protocol(format!("ring broken: {m}")));
        }
        self.consumer.try_pop().map_err(|e| {
            let e = ring_err(e);
            self.broken.get_or_insert(e.to_string());
            e
        })
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

/// The slow half of a receive wait: spin, then (with the clock and a liveness check)
/// sleep in slices until the deadline.
struct Waiter<'a, 'd> {
    bell: Doorbell<'a>,
    spin: u32,
    deadline: &'d mut Deadline,
}

impl Waiter<'_, '_> {
    fn wait(&mut self, seen: u32, gone: &dyn Fn() -> bool) -> Result<()> {
        if self.bell.spin(seen, self.deadline.spins(self.spin)) {
            return Ok(());
        }
        let Some(nap) = self.deadline.slice(LIVENESS_SLICE) else {
            return Err(self.deadline.timed_out("a message in the ring"));
        };
        if gone() {
            return Err(Error::peer_gone("the producer went away with nothing left in the ring"));
        }
        self.bell.wait(seen, 0, nap);
        Ok(())
    }
}

/// The receiving half of a ring. Messages may be received from one thread at a time;
/// borrowed messages may be dropped on any thread.
pub struct RingReceiver {
    state: Arc<Mutex<RecvState>>,
    data_bell: Doorbell<'static>,
    // Keeps the mapping `data_bell` points into alive.
    _seg: Arc<Segment>,
}

impl RingReceiver {
    /// `max_message`: largest reassembled message accepted (bounds memory a hostile
    /// producer can make us allocate).
    pub fn new(shared: RingShared, max_message: u64) -> RingReceiver {
        let (ctrl, region) = shared.parts();
        let region_base = region.base as usize;
        let seg = shared.seg.clone();
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
        RingReceiver { state: Arc::new(Mutex::new(state)), data_bell: ctrl.data_bell, _seg: seg }
    }

    /// Receive one message: a copy (`borrow` false), or, for a message that fits one
    /// record, the bytes in place until the message is dropped (`borrow` true).
    /// Waits as `wait` says; `spin` polls come before each sleep.
    pub fn recv(&self, borrow: bool, wait: impl Into<Wait>, spin: u32, gone: &dyn Fn() -> bool) -> Result<RingMessage> {
        let mut waiter = Waiter { bell: self.data_bell, spin, deadline: &mut wait.into().deadline() };
        loop {
            let seen = self.data_bell.current();
            if let Some(m) = self.state.lock().poll(borrow, &self.state)? {
                return Ok(m);
            }
            waiter.wait(seen, gone)?;
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
        let mut waiter = Waiter { bell: self.data_bell, spin, deadline };
        let mut desc = None;
        loop {
            let seen = self.data_bell.current();
            if let Some(tag) = self.state.lock().poll_into(buf, &mut desc)? {
                return Ok((tag, desc));
            }
            waiter.wait(seen, gone)?;
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
