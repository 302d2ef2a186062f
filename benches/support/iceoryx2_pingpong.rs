//! iceoryx2 publish-subscribe ping-pong between the bench (CPU 0) and its child (CPU 1), the
//! comparison point for the ring's spinning latency. It mirrors iceoryx2's own
//! publish-subscribe benchmark: two services (ping: parent → child, pong: child → parent),
//! each `[u8]` slices of the message size, `history_size(0)`, `subscriber_max_buffer_size(1)`,
//! safe overflow, one publisher and one subscriber; zero-copy loans (`loan_slice_uninit`),
//! the next loan taken right after a send (the echo side holds its loan while it waits, as
//! iceoryx2's does); `ipc::Service`; both sides busy-wait in a bare `receive()` loop.
//!
//! Where it differs from iceoryx2's benchmark, it does so to do the same work as the ring
//! run next to it: two processes instead of two threads; each round trip timed on its own
//! (p50/p99 of half a round trip, as for every other row) instead of one mean; and the bytes
//! are touched on both ends — the sender copies the message into its loan, the receiver
//! copies the sample out into a private buffer before releasing it (the echo then copies
//! that buffer into its own loan), exactly as the ring's `ring_send` copies in and
//! `ring_recv_into` copies out.
//!
//! Everything iceoryx2 puts in the file system — its node and service directories and the
//! shared memory in /dev/shm — carries a prefix and a root directory unique to this run
//! (the parent's pid) and is removed when the run ends (also when it panics). iceoryx2
//! removes its nodes' and services' files itself; the one it keeps by design is its
//! per-domain node counter (`<prefix>…node.<version>.global_mgmt`, persistent shared
//! memory), which the bench removes with the rest. Any other file left in /dev/shm is
//! reported (it would mean an unclean shutdown).

use iceoryx2::port::publisher::Publisher;
use iceoryx2::port::subscriber::Subscriber;
use iceoryx2::prelude::*;
use iceoryx2::sample::Sample;
use iceoryx2::service::port_factory::publish_subscribe::PortFactory;
use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::time::Instant;

/// The child mode that runs [`echo`].
pub const MODE: &str = "iceoryx2";
/// A tag the parent sends last: the echo stops instead of answering.
const STOP: u64 = u64::MAX;
/// Empty polls between two looks at the clock (and, in the child, at the parent).
const POLLS_PER_CHECK: u32 = 1 << 12;

/// This run's names in the file system and in /dev/shm, unique per parent process.
struct Namespace {
    prefix: String,
    root: String,
    ping: String,
    pong: String,
}

impl Namespace {
    fn of(parent_pid: u32) -> Namespace {
        Namespace {
            prefix: format!("twbench{parent_pid}_"),
            root: format!("/tmp/tensorwire-bench-iceoryx2-{parent_pid}/"),
            ping: format!("tensorwire-bench/{parent_pid}/ping"),
            pong: format!("tensorwire-bench/{parent_pid}/pong"),
        }
    }

    fn config(&self) -> Config {
        let mut c = Config::default();
        c.global.prefix = FileName::new(self.prefix.as_bytes()).expect("iceoryx2 file prefix");
        c.global.set_root_path(&Path::new(self.root.as_bytes()).expect("iceoryx2 root path"));
        c
    }

    /// Remove this run's files: the root directory and every /dev/shm entry with our prefix.
    /// Returns the /dev/shm entries other than the persistent node counter, which iceoryx2
    /// should have removed itself.
    fn remove_files(&self) -> Vec<String> {
        let _ = std::fs::remove_dir_all(&self.root);
        let mut unexpected = Vec::new();
        for entry in std::fs::read_dir("/dev/shm").into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with(&self.prefix) {
                let _ = std::fs::remove_file(entry.path());
                if !name.ends_with(".global_mgmt") {
                    unexpected.push(name);
                }
            }
        }
        unexpected
    }
}

/// One side's ports. Fields drop in order: ports, then services, then the node.
struct Ports {
    publisher: Publisher<ipc::Service, [u8], ()>,
    subscriber: Subscriber<ipc::Service, [u8], ()>,
    _services: [PortFactory<ipc::Service, [u8], ()>; 2],
    _node: Node<ipc::Service>,
}

impl Ports {
    /// The parent creates both services (publishing on ping); the child opens them
    /// (publishing on pong).
    fn new(ns: &Namespace, size: usize, parent: bool) -> Ports {
        set_log_level(LogLevel::Error);
        let node = NodeBuilder::new()
            .config(&ns.config())
            .signal_handling_mode(SignalHandlingMode::Disabled)
            .create::<ipc::Service>()
            .expect("iceoryx2 node");
        let service = |name: &str| {
            let builder = node
                .service_builder(&ServiceName::new(name).expect("iceoryx2 service name"))
                .publish_subscribe::<[u8]>()
                .max_publishers(1)
                .max_subscribers(1)
                .history_size(0)
                .subscriber_max_buffer_size(1)
                .enable_safe_overflow(true);
            if parent {
                builder.create().expect("create iceoryx2 service")
            } else {
                builder.open().expect("open iceoryx2 service")
            }
        };
        let (ping, pong) = (service(&ns.ping), service(&ns.pong));
        let (out, inb) = if parent { (&ping, &pong) } else { (&pong, &ping) };
        let publisher = out.publisher_builder().initial_max_slice_len(size).create().expect("iceoryx2 publisher");
        let subscriber = inb.subscriber_builder().create().expect("iceoryx2 subscriber");
        Ports { publisher, subscriber, _services: [ping, pong], _node: node }
    }

    /// Busy-wait for the next sample, as iceoryx2's benchmark does (`receive()` in a bare
    /// loop). `None` after `crate::T` without one, or once `gone()` says the peer is gone.
    fn receive(&self, gone: impl Fn() -> bool) -> Option<Sample<ipc::Service, [u8], ()>> {
        let mut polls = 0u32;
        let mut since: Option<Instant> = None;
        loop {
            if let Some(sample) = self.subscriber.receive().expect("iceoryx2 receive") {
                return Some(sample);
            }
            polls = polls.wrapping_add(1);
            if polls % POLLS_PER_CHECK == 0 && (since.get_or_insert_with(Instant::now).elapsed() > crate::T || gone()) {
                return None;
            }
        }
    }
}

/// Removes this run's iceoryx2 files when the parent's measurement ends, however it ends.
struct Cleanup(Namespace);

impl Drop for Cleanup {
    fn drop(&mut self) {
        let left = self.0.remove_files();
        if !left.is_empty() {
            eprintln!("iceoryx2 left {} file(s) in /dev/shm (removed): {}", left.len(), left.join(" "));
        }
    }
}

/// One-way latency of `size`-byte messages, `iters` timed round trips (after the same
/// warm-up as every other row).
pub fn pingpong(size: usize, iters: usize) -> crate::Stats {
    assert!(size >= 8, "the first 8 bytes carry the round trip's tag");
    let cleanup = Cleanup(Namespace::of(std::process::id()));
    let ports = Ports::new(&cleanup.0, size, true);
    // SAFETY: single-threaded at this point of the bench; the child reads it at start.
    unsafe { std::env::set_var("TW_RING_MSG", size.to_string()) };
    let (a, b) = UnixStream::pair().unwrap();
    let (mut child, _) = crate::spawn_with(MODE, OwnedFd::from(a.try_clone().unwrap()), OwnedFd::from(b));
    let mut ready = a;
    ready.set_read_timeout(Some(crate::T)).unwrap();
    ready.read_exact(&mut [0u8]).expect("iceoryx2 child ready");

    let mut msg = vec![7u8; size];
    let mut back = vec![0u8; size];
    let mut tag = 0u64;
    let mut loan = Some(ports.publisher.loan_slice_uninit(size).expect("iceoryx2 loan"));
    let stats = crate::one_way(iters, || {
        msg[..8].copy_from_slice(&tag.to_le_bytes());
        loan.take().unwrap().write_from_slice(&msg).send().expect("iceoryx2 send");
        loan = Some(ports.publisher.loan_slice_uninit(size).expect("iceoryx2 loan"));
        let sample = ports.receive(|| false).expect("no echo from the iceoryx2 child");
        back.copy_from_slice(sample.payload());
        drop(sample);
        assert_eq!(back[..8], tag.to_le_bytes(), "echo of another round trip");
        tag += 1;
    });
    msg[..8].copy_from_slice(&STOP.to_le_bytes());
    loan.take().unwrap().write_from_slice(&msg).send().expect("iceoryx2 send");
    assert!(child.wait().unwrap().success(), "iceoryx2 child failed");
    drop(ports);
    drop(cleanup);
    stats
}

/// The child's side: answer every message with the same bytes until the parent's STOP, or
/// until the parent is gone.
pub fn echo(fd: OwnedFd) {
    let size: usize = std::env::var("TW_RING_MSG").unwrap().parse().unwrap();
    let parent = std::os::unix::process::parent_id();
    let ports = Ports::new(&Namespace::of(parent), size, false);
    UnixStream::from(fd).write_all(b"r").unwrap();
    let mut buf = vec![0u8; size];
    let mut loan = ports.publisher.loan_slice_uninit(size).expect("iceoryx2 loan");
    loop {
        let Some(sample) = ports.receive(|| std::os::unix::process::parent_id() != parent) else { return };
        buf.copy_from_slice(sample.payload());
        drop(sample);
        if buf[..8] == STOP.to_le_bytes() {
            return;
        }
        loan.write_from_slice(&buf).send().expect("iceoryx2 send");
        loan = ports.publisher.loan_slice_uninit(size).expect("iceoryx2 loan");
    }
}
