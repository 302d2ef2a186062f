//! The worker's side: take the connection the supervisor left in the environment, apply
//! the sandbox it asked for, answer the handshake, serve until the supervisor closes.

use super::{Sandbox, CONTROL_ID, FD_ENV, SANDBOX_ENV};
use crate::{Endpoint, Map, Registry, Result, RpcConfig, RpcError, Service, Value};
use std::os::fd::{BorrowedFd, FromRawFd, OwnedFd};

/// Serve `registry` to the supervisor that started this process as a worker, until it
/// closes the connection (then `Ok`); a broken connection or a sandbox that cannot be
/// applied is an error. The handshake is answered only after the sandbox is in place, so
/// a worker the supervisor sees ready is sandboxed as asked.
pub fn serve(registry: Registry, cfg: RpcConfig) -> Result<()> {
    let endpoint = connect(registry, cfg)?;
    match endpoint.wait_closed() {
        RpcError::PeerGone(_) => Ok(()),
        e => Err(e),
    }
}

/// What [`serve`] does before it waits: take the connection, apply the sandbox, register
/// the handshake's answer and start serving `registry` on its endpoint, returned to a
/// worker that also calls the supervisor back (its handlers run on the endpoint's own
/// threads; the caller waits with [`Endpoint::wait_closed`]).
pub fn connect(registry: Registry, cfg: RpcConfig) -> Result<Endpoint> {
    let conn = inherited_connection()?;
    let sandboxed = enter_sandbox()?;
    // The variables stay (editing the environment is not thread-safe, and a Python worker
    // has threads by now): the fd is close-on-exec, so what this worker starts cannot use
    // it, and the sandbox is in place whatever the variable says afterwards.
    let hello = Service::new("Worker").method_inline("hello", move |_, _| {
        let mut m = Map::new();
        m.insert("pid".into(), Value::Int(std::process::id() as i64));
        m.insert("sandboxed".into(), Value::Bool(sandboxed));
        Ok(Value::Object(m))
    });
    registry.register(CONTROL_ID, hello)?;
    Endpoint::from_fd(conn, registry, cfg)
}

/// Apply the system-call policy of the sandbox the supervisor asked for (`SANDBOX_ENV`),
/// once; whether this worker is sandboxed. The rest of the sandbox (namespaces, the
/// file-system allow-list, the environment, the fds, the capabilities) was in place
/// before this process's program started. A worker that runs code it does not trust at
/// start-up (a Python worker importing its target) calls this first; [`connect`] and
/// [`serve`] call it anyway.
pub fn enter_sandbox() -> Result<bool> {
    match std::env::var(SANDBOX_ENV) {
        Ok(text) => {
            super::contain::apply_in_worker(&Sandbox::from_json(&text)?)?;
            Ok(true)
        }
        Err(_) => Ok(false),
    }
}

/// Our end of the connection: the fd `FD_ENV` names, checked to be a Unix socket, made
/// close-on-exec (what this worker starts does not inherit it).
fn inherited_connection() -> Result<OwnedFd> {
    let text = std::env::var(FD_ENV)
        .map_err(|_| RpcError::InvalidArgument(format!("{FD_ENV} is not set: this process was not started as a tensorwire worker")))?;
    let fd: i32 = text.parse().ok().filter(|fd| *fd >= 0).ok_or_else(|| RpcError::InvalidArgument(format!("{FD_ENV}={text:?} is not an fd")))?;
    // SAFETY: fstat on any integer is safe; it only reads the fd table.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is writable; a closed or invalid fd is EBADF.
    if unsafe { libc::fstat(fd, &mut st) } != 0 || st.st_mode & libc::S_IFMT != libc::S_IFSOCK {
        return Err(RpcError::InvalidArgument(format!("{FD_ENV}={fd} is not an open socket")));
    }
    // SAFETY: the fd is open (fstat succeeded) and was left to this process by the
    // supervisor for this one use; nothing else in the process owns it.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: borrowed for the call only; `owned` keeps it open.
    tensorwire::os::set_cloexec(unsafe { BorrowedFd::borrow_raw(fd) }, true).map_err(|e| RpcError::Transport { kind: e.kind(), message: e.to_string() })?;
    Ok(owned)
}
