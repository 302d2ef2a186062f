//! The shared lease table, the producer's private exporter state over it, and the
//! consumer's view of the peer's table.

use super::slot::{self, ReleaseRefused};
use crate::doorbell::{Doorbell, DoorbellWords};
use crate::error::{Error, Result};
use crate::segment::Segment;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64};
use std::sync::{Arc, Weak};
use std::time::Instant;
use crate::wire::lease_table::{CAPACITY_AT, MESSAGE_LINE_OFFSET, SLOT_BYTES, TABLE_HEADER_BYTES, TABLE_MAGIC, TABLE_VERSION};

/// Shared header of a lease table (the consumer may scribble the doorbell words; the
/// producer never reads magic/capacity back, it keeps its own copies). Two doorbells, each
/// on the cache line of the side that rings it: the consumer rings `release` (first line)
/// after giving a lease back; the producer rings `message` (second line) after each
/// control message it sends, and the consumer sleeps on it for the next one
/// ([`message_doorbell`] says why not on the socket).
#[repr(C)]
struct TableHeader {
    magic: u64,
    version: u32,
    capacity: u32,
    release: DoorbellWords,
    /// Fd slots (bit i: slot i) in which the consumer found no fd of the segment a
    /// descriptor named, or whose install it lost (its open-file limit): the producer
    /// takes the bits at its next CPU export and sends those fds again. A hint the
    /// consumer may scribble: a stray bit costs one fd sent again, nothing else.
    lost_fd_slots: AtomicU32,
    _release_line: [u8; 36],
    message: MessageLine,
}

/// The producer's line of a lease table header, about the control messages it sends.
#[repr(C)]
#[derive(Default)]
pub struct MessageLine {
    /// Rung after each message.
    ///
    /// Why a doorbell for socket messages: a receive then waits by polling this line (no
    /// system call per look, unlike poll(2) on the socket), and the line also carries the
    /// sender's CPU, which tells a receiver for certain that the two processes share a core
    /// (`connection::Connection::recv` moves itself to another CPU then; `docs/DESIGN.md`,
    /// "Two processes on one core", has the measurements).
    pub bell: DoorbellWords,
    /// The CPU the producer last sent from, plus one (`sched_getcpu() + 1`; 0 before its
    /// first message and where the kernel cannot say), stored with each message: a
    /// receiver about to wait on the same CPU knows the two share a core. A hint only
    /// (the producer may have moved since, or lie): it costs at most a move of the
    /// receiver to another CPU, at most once per `waiting::cpu::MOVE_AT_MOST_EVERY`.
    pub sender_cpu: AtomicU32,
}

const _: () = assert!(std::mem::offset_of!(TableHeader, capacity) == CAPACITY_AT);
const _: () = assert!(std::mem::offset_of!(TableHeader, message) == MESSAGE_LINE_OFFSET);
const _: () = assert!(std::mem::size_of::<TableHeader>() <= TABLE_HEADER_BYTES);

/// Anything that keeps exported memory alive. Dropping it is the release.
pub type Owner = Box<dyn Send + 'static>;

/// Owners taken out of the private table, to be dropped outside the exporter's lock.
/// A lease counts as live in the stats until its owner has actually been dropped:
/// [`Reclaimed::settle`] drops the owners, then updates the stats.
#[derive(Default)]
pub struct Reclaimed {
    owners: Vec<Owner>,
    leases: u64,
    bytes: u64,
}

impl Reclaimed {
    pub fn is_empty(&self) -> bool {
        self.owners.is_empty() && self.leases == 0
    }

    /// Drop the owners (the caller holds no lock), then account for them.
    pub fn settle(self, exporter: &parking_lot::Mutex<Exporter>) {
        let (leases, bytes) = (self.leases, self.bytes);
        drop(self.owners);
        if leases > 0 {
            let mut ex = exporter.lock();
            ex.stats.live_leases -= leases;
            ex.stats.live_bytes -= bytes;
        }
    }
}

/// Names a lease: slot in the producer's table and the generation it was granted with.
// `#[repr(C)]`: the C ABI hands this out as is, as `tw_lease_t` (cbindgen.toml renames it).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LeaseId {
    pub slot: u32,
    pub generation: u32,
}

/// What a producer exported to one peer: its counters.
// `#[repr(C)]`: the C ABI hands this out as is, as `tw_lease_stats_t` (cbindgen.toml
// renames it).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LeaseStats {
    /// Leases granted and not yet given back.
    pub live_leases: u64,
    /// Bytes of storage those leases keep alive, each storage counted once however many
    /// views of it are leased (the per-peer byte quota is checked against this). A
    /// storage is a region of a segment as exported (its segment, offset and length), or
    /// for device memory each export's own range.
    pub live_bytes: u64,
    /// Leases granted so far.
    pub granted: u64,
    /// Given back by the consumer's release.
    pub released: u64,
    /// Taken back because their window ran out.
    pub expired: u64,
    /// Taken back because the peer died or the connection ended.
    pub reclaimed: u64,
}

struct Entry {
    generation: u32,
    owner: Owner,
    /// The storage it keeps alive: its bytes count in `live_bytes` while any entry names it.
    storage: StorageKey,
    segment_id: u64,
    deadline: Option<Instant>,
}

/// Names a storage for the byte count: a region of a segment (id, offset, length), or
/// for a lease with no segment (device memory) the lease's own slot and generation, so it
/// counts alone.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
enum StorageKey {
    Region { segment_id: u64, base_offset: u64, nbytes: u64 },
    Lease { slot: u32, generation: u32, nbytes: u64 },
}

impl StorageKey {
    fn nbytes(&self) -> u64 {
        match *self {
            StorageKey::Region { nbytes, .. } | StorageKey::Lease { nbytes, .. } => nbytes,
        }
    }
}

/// A CPU storage shown to the peer: the region of a segment (of ours, or a forwarded
/// import's) a lease keeps alive, and what keeps it alive here.
pub struct ShownStorage {
    /// Its segment's id on this connection.
    pub segment_id: u64,
    /// Where the storage starts in the segment.
    pub base_offset: u64,
    pub keeper: StorageKeeper,
}

/// Whatever keeps a CPU storage shown to the peer alive in this process: a `Segment` of
/// ours, or the fd of a forwarded import. Only its liveness is looked at (a `Weak`).
pub type StorageKeeper = Weak<dyn Send + Sync>;

/// What the producer remembers about a segment it showed this peer.
struct SharedSegment {
    segment: StorageKeeper,
    leases: u64,
}

/// Producer-private state for one peer: the lease table it owns and the owners.
pub struct Exporter {
    table: Arc<Segment>,
    capacity: u32,
    max_bytes: u64,
    entries: Vec<Option<Entry>>,
    gens: Vec<u32>,
    free: Vec<u32>,
    /// Slots holding a live entry (reaping scans these, not the whole table), and each
    /// slot's index in it (u32::MAX when not live).
    live: Vec<u32>,
    live_pos: Vec<u32>,
    stats: LeaseStats,
    segments: HashMap<u64, SharedSegment>,
    /// Live leases per storage: a storage's bytes count in `stats.live_bytes` from its
    /// first lease until its last one is taken (and that one's owner dropped).
    storages: HashMap<StorageKey, u64>,
    gone: bool,
}

/// The doorbell in a lease table's header: the consumer rings it after a release, the
/// producer's reaper sleeps on it.
pub fn release_doorbell(table: &Segment) -> Doorbell<'_> {
    assert!(table.len() >= TABLE_HEADER_BYTES);
    // SAFETY: the header lies inside the mapping (checked above; every table is created or
    // validated at ≥ header size), page-aligned, and DoorbellWords is two atomics that the
    // doorbell only accesses atomically.
    Doorbell::new(unsafe { &(*table.as_ptr().cast::<TableHeader>()).release })
}

/// The lease table's lost-fd-slots word (see `TableHeader`): the consumer sets bits in
/// the producer's table, the producer takes them.
pub fn lost_fd_slots(table: &Segment) -> &AtomicU32 {
    assert!(table.len() >= TABLE_HEADER_BYTES);
    // SAFETY: as in `release_doorbell`: the header lies inside the mapping, which is
    // page-aligned; the word is only accessed atomically.
    unsafe { &(*table.as_ptr().cast::<TableHeader>()).lost_fd_slots }
}

fn table_len(capacity: u32) -> usize {
    TABLE_HEADER_BYTES + capacity as usize * SLOT_BYTES
}

impl Exporter {
    /// A fresh table with `capacity` slots (the per-peer lease quota) and a byte quota.
    pub fn new(capacity: u32, max_bytes: u64) -> Result<Exporter> {
        if capacity == 0 {
            return Err(Error::InvalidArgument("lease table capacity must be > 0".into()));
        }
        let table = Arc::new(Segment::create(table_len(capacity))?);
        // SAFETY: the mapping is at least TABLE_HEADER_BYTES long, page-aligned, and
        // freshly zeroed; nobody else has the fd yet, so plain writes are race-free.
        unsafe {
            let h = table.as_ptr().cast::<TableHeader>();
            std::ptr::addr_of_mut!((*h).magic).write(TABLE_MAGIC);
            std::ptr::addr_of_mut!((*h).version).write(TABLE_VERSION);
            std::ptr::addr_of_mut!((*h).capacity).write(capacity);
        }
        Ok(Exporter {
            table,
            capacity,
            max_bytes,
            entries: (0..capacity).map(|_| None).collect(),
            gens: vec![0; capacity as usize],
            free: (0..capacity).rev().collect(),
            live: Vec::new(),
            live_pos: vec![u32::MAX; capacity as usize],
            stats: LeaseStats::default(),
            segments: HashMap::new(),
            storages: HashMap::new(),
            gone: false,
        })
    }

    /// The table segment to send to the peer.
    pub fn table(&self) -> &Arc<Segment> {
        &self.table
    }

    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    fn word(&self, slot: u32) -> &AtomicU64 {
        assert!(slot < self.capacity);
        // SAFETY: slot < capacity, so the word lies inside the table mapping (len =
        // header + capacity*8), 8-aligned (page-aligned base + 64 + 8*slot). AtomicU64 has
        // the layout of u64, and all access to shared words goes through atomics.
        unsafe { &*self.table.as_ptr().add(TABLE_HEADER_BYTES + slot as usize * SLOT_BYTES).cast::<AtomicU64>() }
    }

    pub fn stats(&self) -> LeaseStats {
        self.stats
    }

    /// Grant a lease on `nbytes` of `segment`; returns the lease and whether the segment
    /// is new to this peer.
    pub fn grant(
        &mut self,
        segment: Option<&Arc<Segment>>,
        nbytes: u64,
        owner: Owner,
        deadline: Option<Instant>,
    ) -> std::result::Result<(LeaseId, bool), (Error, Owner)> {
        let shown = segment.map(|s| ShownStorage { segment_id: s.id(), base_offset: 0, keeper: Arc::downgrade(s) as _ });
        self.grant_storage(shown, nbytes, owner, deadline)
    }

    /// `grant` for any CPU storage shown by id (a region of a segment of ours, or of a
    /// forwarded import): `nbytes` of it from `base_offset`.
    pub fn grant_storage(
        &mut self,
        segment: Option<ShownStorage>,
        nbytes: u64,
        owner: Owner,
        deadline: Option<Instant>,
    ) -> std::result::Result<(LeaseId, bool), (Error, Owner)> {
        if self.gone {
            return Err((Error::peer_gone("the connection has ended; no new leases"), owner));
        }
        if self.stats.live_leases >= u64::from(self.capacity) || self.free.is_empty() {
            return Err((
                Error::QuotaExceeded(format!(
                    "peer holds {} leases, the limit is {}; it must release some first",
                    self.stats.live_leases, self.capacity
                )),
                owner,
            ));
        }
        // A storage already under lease adds no bytes: another view of it keeps no more
        // memory alive.
        let region = segment
            .as_ref()
            .map(|s| StorageKey::Region { segment_id: s.segment_id, base_offset: s.base_offset, nbytes });
        let added = match region {
            Some(key) if self.storages.contains_key(&key) => 0,
            _ => nbytes,
        };
        if self.stats.live_bytes.saturating_add(added) > self.max_bytes {
            return Err((
                Error::QuotaExceeded(format!(
                    "peer holds {} bytes of storage under lease; {} more would pass the {}-byte limit",
                    self.stats.live_bytes, added, self.max_bytes
                )),
                owner,
            ));
        }
        let slot = self.free.pop().expect("checked non-empty");
        let generation = slot::next_gen(self.gens[slot as usize]);
        let storage = region.unwrap_or(StorageKey::Lease { slot, generation, nbytes });
        self.gens[slot as usize] = generation;
        slot::grant(self.word(slot), generation);
        // CPU exports track which segments the peer has (so it is told to forget one this
        // side dropped); device memory (CUDA) has no segment.
        let (sid, first) = match segment {
            Some(ShownStorage { segment_id: sid, keeper, .. }) => {
                use std::collections::hash_map::Entry as Slot;
                let first = match self.segments.entry(sid) {
                    Slot::Vacant(v) => {
                        v.insert(SharedSegment { segment: keeper, leases: 1 });
                        true
                    }
                    Slot::Occupied(o) => {
                        let shared = o.into_mut();
                        // Shown before, dropped since and not yet forgotten: new again.
                        let first = shared.segment.strong_count() == 0;
                        if first {
                            shared.segment = keeper;
                        }
                        shared.leases += 1;
                        first
                    }
                };
                (sid, first)
            }
            None => (0, false),
        };
        self.entries[slot as usize] = Some(Entry { generation, owner, storage, segment_id: sid, deadline });
        self.live_pos[slot as usize] = self.live.len() as u32;
        self.live.push(slot);
        *self.storages.entry(storage).or_insert(0) += 1;
        self.stats.live_leases += 1;
        self.stats.live_bytes += added;
        self.stats.granted += 1;
        Ok((LeaseId { slot, generation }, first))
    }

    /// Take entry `slot` out of the private table (the one place an owner leaves it). Its
    /// stats are settled once the owner has been dropped (`Reclaimed::settle`).
    fn take(&mut self, slot: u32, out: &mut Reclaimed) {
        let Some(e) = self.entries[slot as usize].take() else { return };
        let pos = self.live_pos[slot as usize] as usize;
        self.live.swap_remove(pos);
        if let Some(&moved) = self.live.get(pos) {
            self.live_pos[moved as usize] = pos as u32;
        }
        self.live_pos[slot as usize] = u32::MAX;
        if let Some(s) = self.segments.get_mut(&e.segment_id) {
            s.leases -= 1;
        }
        self.free.push(slot);
        out.owners.push(e.owner);
        out.leases += 1;
        // The storage's last lease: its bytes stop counting once the owners are dropped.
        // (Granted again before then, it counts twice for that moment: never too few.)
        if let std::collections::hash_map::Entry::Occupied(mut o) = self.storages.entry(e.storage) {
            *o.get_mut() -= 1;
            if *o.get() == 0 {
                o.remove();
                out.bytes += e.storage.nbytes();
            }
        }
    }

    /// Undo a grant whose descriptor could not be sent.
    pub fn revoke(&mut self, id: LeaseId, out: &mut Reclaimed) {
        if matches!(&self.entries[id.slot as usize], Some(e) if e.generation == id.generation) {
            slot::reclaim(self.word(id.slot), id.generation);
            self.take(id.slot, out);
        }
    }

    /// Collect owners the consumer released and those whose window ran out. Owners are
    /// pushed to `out` so the caller drops them outside its lock.
    pub fn reap(&mut self, now: Instant, out: &mut Reclaimed) -> Option<Instant> {
        let mut next_deadline: Option<Instant> = None;
        let mut i = 0;
        while i < self.live.len() {
            let s = self.live[i];
            let e = self.entries[s as usize].as_ref().expect("live slots hold entries");
            let (generation, deadline) = (e.generation, e.deadline);
            if slot::reap(self.word(s), generation) {
                // `take` moves the last live slot into position i: look at i again.
                self.take(s, out);
                self.stats.released += 1;
                continue;
            }
            if let Some(d) = deadline {
                if d <= now {
                    // Whatever the word says, the window is over: the owner goes.
                    if slot::expire(self.word(s), generation) == slot::Expiry::WasReleased {
                        self.stats.released += 1;
                    } else {
                        self.stats.expired += 1;
                    }
                    self.take(s, out);
                    continue;
                }
                next_deadline = Some(next_deadline.map_or(d, |n| n.min(d)));
            }
            i += 1;
        }
        next_deadline
    }

    /// The peer is gone: take back every lease.
    pub fn reclaim_all(&mut self, out: &mut Reclaimed) {
        self.gone = true;
        while let Some(&s) = self.live.last() {
            let generation = self.entries[s as usize].as_ref().expect("live slots hold entries").generation;
            slot::reclaim(self.word(s), generation);
            self.take(s, out);
            self.stats.reclaimed += 1;
        }
        self.segments.clear();
    }

    /// Forget that the peer has `segment_id` (its fd must travel again next time).
    pub fn unshare_segment(&mut self, segment_id: u64) {
        if self.segments.get(&segment_id).is_some_and(|s| s.leases == 0) {
            self.segments.remove(&segment_id);
        }
    }

    /// Segments the producer dropped and the peer holds no lease on: the peer may
    /// unmap them. Returns their ids (to send as "forget" messages).
    pub fn forgettable_segments(&mut self) -> Vec<u64> {
        let ids: Vec<u64> = self
            .segments
            .iter()
            .filter(|(_, s)| s.leases == 0 && s.segment.strong_count() == 0)
            .map(|(id, _)| *id)
            .collect();
        for id in &ids {
            self.segments.remove(id);
        }
        ids
    }
}

/// The consumer's view of the peer's lease table: it only validates and releases.
pub struct ImportTable {
    table: Arc<Segment>,
    /// Private copy of the capacity, read once at setup and never again from shm.
    capacity: u32,
}

impl ImportTable {
    /// Validate a table fd the peer sent. `claimed` is the capacity from its message.
    pub fn open(fd: std::os::fd::OwnedFd, claimed: u32, max_capacity: u32) -> Result<ImportTable> {
        if claimed == 0 || claimed > max_capacity {
            return Err(Error::Protocol(format!(
                "lease table capacity {claimed} outside 1..={max_capacity}"
            )));
        }
        let table = Segment::from_fd_exact(fd, table_len(claimed), "the peer's lease table")?;
        table.check_header("lease table", (TABLE_MAGIC, TABLE_VERSION), CAPACITY_AT..CAPACITY_AT + 4, claimed.into())?;
        Ok(ImportTable { table: Arc::new(table), capacity: claimed })
    }

    /// The peer's table segment (its message doorbell is what a receive sleeps on).
    pub fn segment(&self) -> &Arc<Segment> {
        &self.table
    }

    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    fn word(&self, lease: LeaseId) -> Result<&AtomicU64> {
        if lease.slot >= self.capacity {
            return Err(Error::StaleLease(format!(
                "lease slot {} out of range (the peer's table has {} slots)",
                lease.slot, self.capacity
            )));
        }
        // SAFETY: slot < private capacity, and the mapping was checked at open to hold
        // header + capacity*8 bytes; 8-aligned; accessed only atomically.
        Ok(unsafe { &*self.table.as_ptr().add(TABLE_HEADER_BYTES + lease.slot as usize * SLOT_BYTES).cast::<AtomicU64>() })
    }

    fn refusal(lease: LeaseId, r: ReleaseRefused) -> Error {
        Error::StaleLease(match r {
            ReleaseRefused::Expired => format!("lease {}:{} expired (its window ran out)", lease.slot, lease.generation),
            ReleaseRefused::AlreadyReleased => format!("lease {}:{} was already released", lease.slot, lease.generation),
            ReleaseRefused::Stale { found_gen, found_state } => format!(
                "lease slot {} holds generation {found_gen} (state {found_state}), not {}",
                lease.slot, lease.generation
            ),
        })
    }

    /// Check that `lease` is live right now (at import).
    pub fn check_live(&self, lease: LeaseId) -> Result<()> {
        slot::is_live(self.word(lease)?, lease.generation).map_err(|r| Self::refusal(lease, r))
    }

    /// Release `lease` and ring the producer's doorbell.
    pub fn release(&self, lease: LeaseId) -> Result<()> {
        slot::release(self.word(lease)?, lease.generation).map_err(|r| Self::refusal(lease, r))?;
        release_doorbell(&self.table).ring();
        Ok(())
    }
}
