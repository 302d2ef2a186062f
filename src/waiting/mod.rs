//! How every wait on the other process goes, apart from what is waited for: whether to
//! spin, yield or sleep ([`spin_policy`]), the doorbell wait that rings and a connection's
//! receive share ([`waiter`]), a connection's receive on its socket or on the peer's
//! message doorbell ([`message`]), and moving a waiting thread off a CPU it shares with
//! the peer ([`cpu`]). Below `connection` and `ring`, which say what they wait for.

pub(crate) mod cpu;
pub(crate) mod message;
pub(crate) mod spin_policy;
pub(crate) mod waiter;
