//! The UCX engine (`ucx-rs` 0.1.0+ucx.1.22.0, its raw `sys` layer).
//!
//! `ucx-rs` binds UCP and nothing more: context/worker/endpoint lifecycle, `ucp_mem_map`,
//! `ucp_rkey_pack` / `ucp_ep_rkey_unpack`, `ucp_get_nbx`, wakeup fds. Everything here is
//! written against those raw functions; every call is in this module tree.
//!
//! - [`Exporter`]: one UCX context + worker and a progress thread that sleeps on the
//!   worker's wakeup fd. Over tcp and shared memory UCX emulates the "one-sided" get with
//!   active messages, so the exporter's worker must be progressed for a get to complete.
//!   Exports live in a [`PeerScope`] — one per importer connection — and are released by id
//!   or all at once when the scope is dropped (the connection died).
//! - [`Importer`]: one context + worker, progressed by the importing thread; endpoints to
//!   exporters are cached by worker address, created with peer error handling so an
//!   exporter's death fails the transfer instead of hanging it.
//!
//! Transports are chosen by UCX from its environment (`UCX_TLS=tcp`, `UCX_TLS=sm,self`).

mod export;
mod import;
mod worker;

pub use export::{Exporter, PeerScope};
pub use import::Importer;

/// Keeps the `ucx-rs` crate in the link: it forces UCX's static constructors from a
/// `#[used]` static that is only linked when the crate is named (its documented invariant).
use ucx_rs as _;
