//! The UCX engine (`ucx-rs` 0.1.0+ucx.1.22.0, its raw `sys` layer).
//!
//! `ucx-rs` binds UCP as raw `sys` functions: context/worker/endpoint lifecycle, active
//! messages (`ucp_worker_set_am_recv_handler`, `ucp_am_send_nbx`, `ucp_am_recv_data_nbx`),
//! wakeup fds. Everything here is written against those raw functions; every call is in
//! this module tree, each `unsafe` with the reason it is sound.
//!
//! - [`Exporter`]: one UCX context + worker and a progress thread that sleeps on the
//!   worker's wakeup fd and answers requests (`proto.rs`). Exports live in a [`PeerScope`]
//!   — one per importer connection, with a random key — and are released by id or all at
//!   once when the scope is dropped (the connection died).
//! - [`Importer`]: one context + worker, progressed by the importing thread; endpoints to
//!   exporters are cached by worker address, created with peer error handling so an
//!   exporter's death fails the transfer instead of hanging it.
//!
//! Transfers are two-sided: the importer asks for an export by id and key, the exporter
//! sends that export's bytes. No memory is registered for remote access and no remote key
//! is handed out, so UCX's software-emulated one-sided get (which reads whatever address a
//! request names) is never reachable from a peer.
//!
//! Transports are chosen by UCX from its environment (`UCX_TLS=tcp`, `UCX_NET_DEVICES`).

mod export;
mod import;
mod proto;
mod worker;

pub use export::{Exporter, PeerScope};
pub use import::Importer;

/// Keeps the `ucx-rs` crate in the link: it forces UCX's static constructors from a
/// `#[used]` static that is only linked when the crate is named (its documented invariant).
use ucx_rs as _;
