//! The Linux calls the RPC layer (`tensorwire-rpc`), the tests and the tools share with the
//! transport, public on purpose: a SEQPACKET socketpair and handing one end to a child,
//! fd-carrying messages, `poll`, memfds and their seals, `getrandom`. Each is a checked
//! wrapper returning `Error::Io` naming the call. The rest of the crate's wrappers
//! (`sys`) are private: what they do is the transport's business.

pub use crate::sys::{
    add_seals, fstat, ftruncate, getrandom, inherit_in_child, memfd_create, poll_events, recv_msg, send_msg, seqpacket_pair,
    set_cloexec, Received, MAX_POLL_FDS,
};
