//! Loom models of the shared-memory protocols, run against the production code through
//! the `tensorwire::sync` shim:
//!
//! ```text
//! RUSTFLAGS="--cfg loom" cargo test --release -p tensorwire-loom --test loom --target-dir target-loom
//! ```
//!
//! * `doorbell_*`: no lost wake-up between `Doorbell::ring` and `Doorbell::wait` (a lost
//!   one leaves the waiter asleep in the modelled FUTEX_WAIT, which loom reports as a
//!   deadlock), and what the ringer wrote before ringing is visible after the wait.
//! * `lease_*`: the lease-slot word (`lease::slot`) under every interleaving of the
//!   consumer's release with the producer's reap, window expiry and peer-death reclaim,
//!   with the producer-private owner table modelled as in `src/lease/table.rs` (a mutex
//!   over `Option<Entry>`, an owner leaves it only through `take`). Owners are dropped
//!   exactly once, the consumer's release result always agrees with what the producer
//!   did, the consumer's last access to the leased memory happens-before the memory is
//!   reused, and a stale generation never releases a newer lease.
//!
//! The small models are explored exhaustively; the larger ones (three or more threads,
//! loops) with a preemption bound of 4. `LOOM_MAX_PREEMPTIONS` overrides the bound. The
//! whole file runs in a few seconds in release mode.
//!
//! Each model has been seen to fail on a deliberately broken protocol: `ring` skipping
//! the FUTEX_WAKE, `ring` reading `waiters` before bumping `seq`, `wait` never counting
//! itself as a waiter (all: deadlock), `current` loading Relaxed (stale data after the
//! wake, or a wait on an already-rung sequence), `release` as a plain store or without
//! Release ordering, `reap` with Relaxed success ordering (data race on the reused
//! memory), `release` ignoring the generation, `expire` as a blind store, and `expire`
//! without its fall-back reap (an honest release reads as scribbled).
#![cfg(loom)]
// The loom `UnsafeCell`s stand for shared memory that several threads access; they are
// not `Sync` (loom's `spawn` does not ask for `Send`), and loom itself checks every access.
#![allow(clippy::arc_with_non_send_sync)]

use loom::cell::UnsafeCell;
use loom::sync::Mutex;
use loom::sync::atomic::{AtomicBool, AtomicUsize};
use loom::thread;
// std's Arc, not loom's: the models need no causality from reference counts (every clone
// is made before the spawn that hands it over), and loom's Arc drop calls into the loom
// runtime, which aborts the whole test binary (double panic) when a model fails with a
// deadlock while Arcs are still on the blocked thread's stack.
use std::sync::Arc;
use tensorwire::doorbell::{Doorbell, DoorbellWords};
use tensorwire::lease::slot::{self, Expiry, ReleaseRefused};
use tensorwire::sync::{AtomicU64, Ordering};

/// Run `f` under loom, exhaustively (`None`) or with a preemption bound; the
/// `LOOM_MAX_PREEMPTIONS` environment variable overrides either.
fn model<F>(bound: Option<usize>, f: F)
where
    F: Fn() + Sync + Send + 'static,
{
    let mut b = loom::model::Builder::new();
    if b.preemption_bound.is_none() {
        b.preemption_bound = bound;
    }
    let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = runs.clone();
    let start = std::time::Instant::now();
    b.check(move || {
        counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        f()
    });
    eprintln!(
        "{}: {} interleavings (preemption bound {:?}) in {:.2?}",
        thread_name(),
        runs.load(std::sync::atomic::Ordering::Relaxed),
        b.preemption_bound,
        start.elapsed()
    );
}

fn thread_name() -> String {
    std::thread::current().name().unwrap_or("?").to_string()
}

/// Fresh doorbell words, as a zeroed shared mapping gives them.
fn fresh_words() -> Arc<DoorbellWords> {
    Arc::new(DoorbellWords::default())
}

// ---------------------------------------------------------------------------------------
// Doorbell
// ---------------------------------------------------------------------------------------

/// One ringer publishes a payload and rings; the waiter checks for it and, if absent,
/// waits. A lost wake-up deadlocks; a wake-up that does not carry the ringer's writes
/// fails the asserts or is a data race on `payload`.
fn doorbell_one_ring(spin: u32) {
    model(None, move || {
        let words = fresh_words();
        let payload = Arc::new(UnsafeCell::new(0u64));
        let ready = Arc::new(AtomicBool::new(false));

        let ringer = {
            let (words, payload, ready) = (words.clone(), payload.clone(), ready.clone());
            thread::spawn(move || {
                // SAFETY: the waiter reads `payload` only after it has synchronised with
                // the `ready` store or the ring below (that is what this model checks).
                payload.with_mut(|p| unsafe { *p = 42 });
                ready.store(true, Ordering::Release);
                Doorbell::new(&words).ring();
            })
        };

        let db = Doorbell::new(&words);
        let seen = db.current();
        if !ready.load(Ordering::Acquire) {
            assert!(
                db.wait(seen, spin, None),
                "wait without a timeout returned false"
            );
            // The wait returned because the sequence moved: the ring, which came after the
            // ready store, so the store must be visible (Acquire in current()/wait).
            assert!(
                ready.load(Ordering::Relaxed),
                "woken, but the ringer's write is not visible"
            );
        }
        // SAFETY: synchronised with the ringer's write through `ready` or the doorbell.
        payload.with(|p| assert_eq!(unsafe { *p }, 42));
        ringer.join().unwrap();
    });
}

#[test]
fn doorbell_no_lost_wakeup_spin0() {
    doorbell_one_ring(0);
}

#[test]
fn doorbell_no_lost_wakeup_spin1() {
    doorbell_one_ring(1);
}

/// Two rings, two waits in a row on the same thread (the second wait starts with the
/// waiter count its first wait left behind): the waiter must see both publications.
fn doorbell_two_rings(spin: u32) {
    model(Some(4), move || {
        let words = fresh_words();
        let published = Arc::new(AtomicU64::new(0));

        let ringer = {
            let (words, published) = (words.clone(), published.clone());
            thread::spawn(move || {
                let db = Doorbell::new(&words);
                published.store(1, Ordering::Relaxed);
                db.ring();
                published.store(2, Ordering::Relaxed);
                db.ring();
            })
        };

        let db = Doorbell::new(&words);
        let mut waits = 0;
        loop {
            let seen = db.current();
            if published.load(Ordering::Relaxed) == 2 {
                break;
            }
            // `seen` says how many rings this thread has synchronised with; each ring
            // came after its publication.
            assert!(u64::from(seen) <= published.load(Ordering::Relaxed));
            assert!(db.wait(seen, spin, None));
            waits += 1;
            assert!(waits <= 2, "more waits than rings");
        }
        ringer.join().unwrap();
        assert_eq!(db.current(), 2);
    });
}

#[test]
fn doorbell_two_rings_spin0() {
    doorbell_two_rings(0);
}

#[test]
fn doorbell_two_rings_spin1() {
    doorbell_two_rings(1);
}

/// One ring must wake every sleeper (FUTEX_WAKE of all waiters).
#[test]
fn doorbell_one_ring_two_waiters() {
    model(Some(4), || {
        let words = fresh_words();
        let ready = Arc::new(AtomicBool::new(false));

        let waiters: Vec<_> = (0..2)
            .map(|_| {
                let (words, ready) = (words.clone(), ready.clone());
                thread::spawn(move || {
                    let db = Doorbell::new(&words);
                    let seen = db.current();
                    if !ready.load(Ordering::Relaxed) {
                        assert!(db.wait(seen, 0, None));
                        assert!(ready.load(Ordering::Relaxed));
                    }
                })
            })
            .collect();

        ready.store(true, Ordering::Relaxed);
        Doorbell::new(&words).ring();
        for w in waiters {
            w.join().unwrap();
        }
    });
}

// ---------------------------------------------------------------------------------------
// Lease slots
// ---------------------------------------------------------------------------------------

const GEN: u32 = 1;

/// What keeps the leased memory alive. Dropping it is giving the memory back; it counts
/// its drops, and when the memory is marked for reuse it writes to it, so loom reports a
/// data race if the consumer's last access did not happen-before the drop.
struct Owner {
    drops: Arc<AtomicUsize>,
    mem: Arc<UnsafeCell<u64>>,
    reuse: bool,
}

impl Drop for Owner {
    fn drop(&mut self) {
        self.drops.fetch_add(1, Ordering::Relaxed);
        if self.reuse {
            // SAFETY: only sound if every consumer access happened-before this drop,
            // which is exactly what the model checks (loom flags the race otherwise).
            self.mem.with_mut(|m| unsafe { *m = 0xdead });
        }
    }
}

/// The producer's private entry for one slot (`table.rs`'s `Entry`, reduced).
struct Entry {
    generation: u32,
    owner: Owner,
}

/// Shared state of one lease-slot model.
struct Lease {
    word: AtomicU64,
    table: Mutex<Option<Entry>>,
    drops: Arc<AtomicUsize>,
    mem: Arc<UnsafeCell<u64>>,
    words: DoorbellWords,
}

impl Lease {
    /// A slot with lease `GEN` granted: the entry first, then the word, as `Exporter::grant`.
    fn granted() -> Arc<Lease> {
        let drops = Arc::new(AtomicUsize::new(0));
        let mem = Arc::new(UnsafeCell::new(7u64));
        let owner = Owner {
            drops: drops.clone(),
            mem: mem.clone(),
            reuse: false,
        };
        let lease = Lease {
            word: AtomicU64::new(0),
            table: Mutex::new(Some(Entry {
                generation: GEN,
                owner,
            })),
            drops,
            mem,
            words: DoorbellWords::default(),
        };
        slot::grant(&lease.word, GEN);
        Arc::new(lease)
    }

    fn doorbell(&self) -> Doorbell<'_> {
        Doorbell::new(&self.words)
    }

    /// Consumer: use the leased memory, then release (as `ImportTable::release`, ringing
    /// the doorbell on success when `ring`).
    fn consume_and_release(&self, generation: u32, ring: bool) -> Result<(), ReleaseRefused> {
        // SAFETY: the lease is live or (expiry / reclaim) the producer does not reuse the
        // memory in this model; reuse happens only after a reap, which the release orders.
        self.mem
            .with(|m| assert_ne!(unsafe { *m }, 0xdead, "consumer saw reused memory"));
        let r = slot::release(&self.word, generation);
        if r.is_ok() && ring {
            self.doorbell().ring();
        }
        r
    }

    /// Producer reaper, one pass (`Exporter::reap` without a deadline): returns whether
    /// it took the owner. The owner is dropped outside the lock, like the `out` vector.
    fn reap_once(&self, reuse: bool) -> bool {
        let owner = {
            let mut t = self.table.lock().unwrap();
            let generation = match t.as_ref() {
                Some(e) => e.generation,
                None => return false,
            };
            if !slot::reap(&self.word, generation) {
                return false;
            }
            t.take().map(|e| e.owner)
        };
        let mut owner = owner.expect("entry present under the lock");
        owner.reuse = reuse;
        drop(owner);
        true
    }

    /// Producer, the window ran out (`Exporter::reap` past the deadline): `None` if the
    /// entry was gone already. The memory is reused only if the consumer had released.
    fn expire_once(&self) -> Option<Expiry> {
        let (expiry, mut owner) = {
            let mut t = self.table.lock().unwrap();
            let generation = t.as_ref()?.generation;
            let expiry = slot::expire(&self.word, generation);
            (expiry, t.take().unwrap().owner)
        };
        owner.reuse = expiry == Expiry::WasReleased;
        drop(owner);
        Some(expiry)
    }

    /// Producer, the peer died (`Exporter::reclaim_all`): whether it took the owner.
    fn reclaim_once(&self) -> bool {
        let owner = {
            let mut t = self.table.lock().unwrap();
            let Some(e) = t.take() else { return false };
            slot::reclaim(&self.word, e.generation);
            e.owner
        };
        drop(owner);
        true
    }

    fn word(&self) -> (u32, u32) {
        slot::unpack(self.word.load(Ordering::Relaxed))
    }

    fn drops(&self) -> usize {
        self.drops.load(Ordering::Relaxed)
    }
}

/// Consumer release vs a reaper sleeping on the release doorbell: no lost wake-up on the
/// release path, and the consumer's use of the memory happens-before the reaper reuses
/// it (release's Release pairs with reap's Acquire).
fn lease_release_wakes_reaper(spin: u32) {
    model(None, move || {
        let lease = Lease::granted();
        let consumer = {
            let lease = lease.clone();
            thread::spawn(move || lease.consume_and_release(GEN, true))
        };

        let db = lease.doorbell();
        let mut passes = 0;
        loop {
            let seen = db.current();
            passes += 1;
            if lease.reap_once(true) {
                break;
            }
            assert!(passes <= 2, "reaper woke without a release to reap");
            assert!(db.wait(seen, spin, None));
        }

        assert_eq!(consumer.join().unwrap(), Ok(()));
        assert_eq!(lease.drops(), 1);
        assert_eq!(lease.word(), (GEN, slot::FREE));
        assert!(lease.table.lock().unwrap().is_none());
        // A second release of the same lease is refused and changes nothing.
        assert_eq!(
            slot::release(&lease.word, GEN),
            Err(ReleaseRefused::AlreadyReleased)
        );
        assert_eq!(lease.word(), (GEN, slot::FREE));
    });
}

#[test]
fn lease_release_wakes_reaper_spin0() {
    lease_release_wakes_reaper(0);
}

#[test]
fn lease_release_wakes_reaper_spin1() {
    lease_release_wakes_reaper(1);
}

/// Consumer release vs window expiry: exactly one of them wins the word, the owner is
/// dropped once, and when the consumer had released first, its use of the memory
/// happens-before the producer reuses it.
#[test]
fn lease_release_vs_expire() {
    model(None, || {
        let lease = Lease::granted();
        let consumer = {
            let lease = lease.clone();
            thread::spawn(move || lease.consume_and_release(GEN, false))
        };
        let expiry = lease.expire_once().expect("nobody else takes the entry");
        let released = consumer.join().unwrap();

        assert_eq!(lease.drops(), 1);
        match expiry {
            Expiry::Expired => {
                assert_eq!(released, Err(ReleaseRefused::Expired));
                assert_eq!(lease.word(), (GEN, slot::EXPIRED));
            }
            Expiry::WasReleased => {
                assert_eq!(released, Ok(()));
                assert_eq!(lease.word(), (GEN, slot::FREE));
            }
            Expiry::Scribbled => panic!("an honest consumer's word read as scribbled"),
        }
    });
}

/// Who took the owner out of the producer's table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Taker {
    Reaper,
    Expiry(Expiry),
    Reclaim,
}

/// Consumer release vs producer reap vs window expiry vs peer-death reclaim, all at once
/// (four threads, the producer paths serialised by the private table's lock as in
/// `Exporter`). The owner is dropped exactly once, by exactly one path, and the
/// consumer's answer and the final word agree with that path.
#[test]
fn lease_release_vs_reap_vs_expire_vs_reclaim() {
    model(Some(4), || {
        let lease = Lease::granted();
        let spawn = |f: fn(&Lease) -> Option<Taker>| {
            let lease = lease.clone();
            thread::spawn(move || f(&lease))
        };
        let reaper = spawn(|l| l.reap_once(false).then_some(Taker::Reaper));
        let expirer = spawn(|l| l.expire_once().map(Taker::Expiry));
        let reclaimer = spawn(|l| l.reclaim_once().then_some(Taker::Reclaim));
        let released = lease.consume_and_release(GEN, false);

        let takers: Vec<Taker> = [reaper, expirer, reclaimer]
            .into_iter()
            .filter_map(|t| t.join().unwrap())
            .collect();
        // Expiry and reclaim take the entry unconditionally, so someone always does.
        assert_eq!(takers.len(), 1, "owner taken by {takers:?}");
        assert_eq!(lease.drops(), 1, "owner dropped {} times", lease.drops());
        assert!(lease.table.lock().unwrap().is_none());

        match (takers[0], released) {
            // The reaper takes only what the consumer released.
            (Taker::Reaper, Ok(())) => assert_eq!(lease.word(), (GEN, slot::FREE)),
            (Taker::Expiry(Expiry::WasReleased), Ok(())) => {
                assert_eq!(lease.word(), (GEN, slot::FREE))
            }
            (Taker::Expiry(Expiry::Expired), Err(ReleaseRefused::Expired)) => {
                assert_eq!(lease.word(), (GEN, slot::EXPIRED))
            }
            // Reclaim before the release: the consumer is told it was given back already.
            (Taker::Reclaim, Err(ReleaseRefused::AlreadyReleased)) => {
                assert_eq!(lease.word(), (GEN, slot::FREE))
            }
            // Reclaim after the release: the release had succeeded. Under C11 the word ends
            // FREE (the release's CAS read LIVE, so reclaim's store is later in modification
            // order), but loom orders a blind store only after what its own thread has seen
            // and also lets the final load read RELEASED. Either is harmless: the consumer
            // is gone and the next grant stores over the word.
            (Taker::Reclaim, Ok(())) => {
                let w = lease.word();
                assert!(
                    w == (GEN, slot::FREE) || w == (GEN, slot::RELEASED),
                    "word {w:?} after reclaim"
                );
            }
            (t, r) => panic!("inconsistent: owner taken by {t:?}, consumer's release gave {r:?}"),
        }
    });
}

/// A stale release: the consumer releases lease `GEN`, rings, and then releases it again
/// (a duplicate, or a handle kept too long), while the producer reaps `GEN` and grants the
/// slot to the next generation. The duplicate must be refused and must leave the new
/// lease live and its owner alive.
#[test]
fn lease_stale_generation_after_regrant() {
    model(None, || {
        let lease = Lease::granted();
        let next = slot::next_gen(GEN);
        let consumer = {
            let lease = lease.clone();
            thread::spawn(move || {
                let first = lease.consume_and_release(GEN, true);
                let again = slot::release(&lease.word, GEN);
                (first, again)
            })
        };

        // Producer: sleep on the doorbell until the release can be reaped, then grant the
        // slot anew (entry first, then the word, as `Exporter::grant`).
        let drops2 = Arc::new(AtomicUsize::new(0));
        let db = lease.doorbell();
        loop {
            let seen = db.current();
            if lease.reap_once(false) {
                break;
            }
            assert!(db.wait(seen, 0, None));
        }
        {
            let mut t = lease.table.lock().unwrap();
            assert!(t.is_none());
            let owner = Owner {
                drops: drops2.clone(),
                mem: lease.mem.clone(),
                reuse: false,
            };
            *t = Some(Entry {
                generation: next,
                owner,
            });
            slot::grant(&lease.word, next);
        }

        let (first, again) = consumer.join().unwrap();
        assert_eq!(first, Ok(()));
        match again {
            Err(ReleaseRefused::AlreadyReleased) => {}
            Err(ReleaseRefused::Stale {
                found_gen,
                found_state,
            }) => {
                assert_eq!((found_gen, found_state), (next, slot::LIVE))
            }
            r => panic!("stale release of generation {GEN} gave {r:?}"),
        }
        assert_eq!(lease.drops(), 1);
        assert_eq!(
            drops2.load(Ordering::Relaxed),
            0,
            "the new lease's owner was dropped"
        );
        assert_eq!(
            lease.word(),
            (next, slot::LIVE),
            "the stale release touched the new lease"
        );
        assert_eq!(slot::is_live(&lease.word, next), Ok(()));
        assert!(
            !lease.reap_once(false),
            "the new lease reaps without a release"
        );
        // The new lease still works normally.
        assert_eq!(slot::release(&lease.word, next), Ok(()));
        assert!(lease.reap_once(false));
        assert_eq!(drops2.load(Ordering::Relaxed), 1);
    });
}

// ---------------------------------------------------------------------------------------
// Slot credits (the GPU bounce ring's slot reuse, `credits`)
// ---------------------------------------------------------------------------------------

/// A producer makes `USES` uses of 2 slots; a consumer takes each use (announced through
/// `head`, which stands for the descriptor ring modelled in `loom/tests/loom_ring.rs`), reads its
/// slot and frees it. The producer must not write a slot before the consumer's read of the
/// slot's previous use happened-before (a data race on the slot otherwise), the consumer
/// sees each use's write, and a producer asleep for credit is always woken (deadlock
/// otherwise). Seen to fail with `free` storing Relaxed (race), with `poll` loading
/// Relaxed (race), with `poll` allowing `slots + 1` uses in flight (race / wrong value),
/// and with `free` not ringing (deadlock).
fn credits_reuse(spin: u32) {
    use tensorwire::credits::Credits;
    const USES: u64 = 3;
    model(Some(3), move || {
        let freed = Arc::new(AtomicU64::new(0));
        let bell = fresh_words();
        let head = Arc::new(AtomicU64::new(0));
        let slots = Arc::new([UnsafeCell::new(u64::MAX), UnsafeCell::new(u64::MAX)]);

        let consumer = {
            let (freed, bell, head, slots) = (freed.clone(), bell.clone(), head.clone(), slots.clone());
            thread::spawn(move || {
                let c = Credits::new(&freed, &bell, 2);
                for seq in 0..USES {
                    // Acquire: pairs with the producer's Release store of `head`.
                    while head.load(Ordering::Acquire) <= seq {
                        thread::yield_now();
                    }
                    // SAFETY: the producer wrote this slot before publishing `head`, and
                    // writes it again only after our `free` below (what is checked).
                    slots[(seq % 2) as usize].with(|p| assert_eq!(unsafe { *p }, seq, "consumer read a stale slot"));
                    c.free(seq);
                }
            })
        };

        let c = Credits::new(&freed, &bell, 2);
        let long = std::time::Duration::from_secs(3600);
        for seq in 0..USES {
            c.wait(seq, spin, long, long, &|| false).expect("credit");
            // SAFETY: the credit says the consumer's last read of this slot happened-before.
            slots[(seq % 2) as usize].with_mut(|p| unsafe { *p = seq });
            // Release: pairs with the consumer's Acquire load of `head`.
            head.store(seq + 1, Ordering::Release);
        }
        consumer.join().unwrap();
    });
}

#[test]
fn credits_reuse_spin0() {
    credits_reuse(0);
}

#[test]
fn credits_reuse_spin1() {
    credits_reuse(1);
}

/// A CUDA signal word (`tensorwire::signal_word`): the producer (its stream, modelled as a
/// thread) writes data, then the word's values 1 and 2 in order; the consumer's watchdog
/// raises the word to 1 at the same time (the producer is late); a reader that sees value
/// 2 reads the data. Whatever the interleaving, the word ends at 2 (a raise never lowers a
/// value the producer wrote), and the data written before value 2 is what the reader sees
/// (loom reports the race otherwise). Fails when `raise` is a blind store (the word can
/// end at 1) or `load` is Relaxed (a data race on the read). The producer's writes are
/// modelled as swaps: loom 0.7 can order a plain store after a compare-and-swap that read
/// the value before it (tokio-rs/loom issue 282), which no real memory does.
#[test]
fn signal_word_raise_never_lowers_and_a_seen_value_publishes_the_work() {
    use tensorwire::signal_word::{load, raise, reached};
    use tensorwire::sync::AtomicU32;
    model(None, || {
        let word = Arc::new(AtomicU32::new(0));
        let data = Arc::new(UnsafeCell::new(0u64));
        let producer = {
            let (word, data) = (word.clone(), data.clone());
            thread::spawn(move || {
                // SAFETY: loom checks this access against the reader's.
                data.with_mut(|d| unsafe { *d = 42 });
                word.swap(1, Ordering::Release);
                word.swap(2, Ordering::Release);
            })
        };
        let watchdog = {
            let word = word.clone();
            thread::spawn(move || {
                raise(&word, 1);
            })
        };
        if reached(load(&word), 2) {
            // SAFETY: loom checks this access against the producer's.
            assert_eq!(data.with(|d| unsafe { *d }), 42);
        }
        producer.join().unwrap();
        watchdog.join().unwrap();
        assert_eq!(load(&word), 2, "a raise lowered the producer's value");
    });
}
