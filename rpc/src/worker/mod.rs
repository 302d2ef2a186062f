//! Workers: child processes that serve calls, started, held to deadlines and replaced by a
//! supervisor in this process.
//!
//! A [`WorkerSpec`] says what to run and how: program and arguments, environment, where its
//! stdout/stderr go ([`Output`]), resource limits ([`Limits`]), an optional [`Sandbox`],
//! the handshake's time-out (which covers the child's own start-up: a Python child imports
//! torch before it answers) and a default per-call deadline. [`WorkerSpec::spawn`] starts
//! one [`Worker`]; a [`WorkerPool`] keeps warm ones.
//!
//! The child's side is [`serve`]: it finds its end of the connection in the environment
//! (an inherited socketpair end: no path anyone could guess or connect to), applies the
//! sandbox the supervisor asked for, answers the handshake and serves its registry until
//! the supervisor closes the connection.
//!
//! What each failure leaves behind (`docs/DESIGN.md`, "Workers", has the state diagram):
//! - a call past its deadline: the worker's process group is killed (SIGKILL) and reaped,
//!   its leases on our tensors are reclaimed by the transport, the call fails with
//!   `RpcError::Timeout`, every other call in flight on it with `RpcError::PeerGone`, and
//!   a fresh worker starts at once in the background for the next call;
//! - a crash (a signal, `exit`) under a call: every call in flight fails with
//!   `RpcError::PeerGone` naming the signal or the exit status; a fresh worker starts in
//!   the background;
//! - a call given up ([`Worker::cancel_call`], e.g. a Python caller's Ctrl-C): the
//!   [`OnInterrupt`] policy kills the worker (and starts its replacement) or abandons the
//!   call;
//! - the supervisor's death: the child gets SIGKILL from the kernel (`PR_SET_PDEATHSIG`),
//!   and a child whose parent was already gone when it started exits at once;
//! - a hostile child (garbage frames, oversized or over-deep values): the connection fails
//!   with a typed error, the worker is killed, nothing else in this process is touched.

mod child;
mod contain;
mod handle;
mod launch;
mod output;
mod pool;
mod process;
mod sandbox;
mod spec;
mod zygote;

pub use child::{connect, enter_sandbox, serve};
pub use contain::{probe, Containment, KEPT_ENV, KEPT_ENV_PREFIXES};
pub use handle::{OnInterrupt, Worker, WorkerCall, WorkerState};
pub use output::Captured;
pub use pool::{PooledWorker, WorkerPool};
pub use sandbox::Sandbox;
pub use spec::{Limits, Output, WorkerSpec};

/// For a zygote (`docs/DESIGN.md`, "The zygote"): in the single-threaded child it has
/// just forked for a worker of a sandboxed spec, make the set-up an exec'd sandboxed
/// worker gets before exec — with namespaces, this process becomes the worker's keeper
/// and never returns, and the call returns in the worker, pid 1 of its namespaces —
/// then close every fd but 0-2 and `conn`. `ruleset`, the id maps and the flags are what
/// the supervisor's request carried. The system-call policy comes later, as for an
/// exec'd worker ([`enter_sandbox`], from `SANDBOX_ENV`).
///
/// # Safety
/// Only in a single-threaded child of a fork, before anything else runs in it (it makes
/// async-signal-safe system calls only); nothing in the process may use the fds it
/// closes again.
pub unsafe fn confine_forked_worker(
    ruleset: std::os::fd::RawFd,
    uid_map: &[u8],
    gid_map: &[u8],
    namespaces: bool,
    own_proc: bool,
    conn: std::os::fd::RawFd,
) -> std::io::Result<()> {
    // SAFETY: per this function's contract.
    unsafe { contain::confine_forked(ruleset, uid_map, gid_map, namespaces, own_proc, conn) }
}

/// The environment variable naming the child's end of the connection (an fd number).
pub const FD_ENV: &str = "TENSORWIRE_WORKER_FD";
/// The environment variable holding the sandbox the child applies to itself (JSON).
pub const SANDBOX_ENV: &str = "TENSORWIRE_WORKER_SANDBOX";
/// The object id of the worker's own control service (the handshake).
pub const CONTROL_ID: &str = "__tensorwire_worker__";
