//! Accept loop: serve a [`Registry`] to every peer that connects to a Unix socket path
//! (or a TCP address), at most `RpcConfig::max_connections` at once. A failed accept is
//! logged and survived (the policy is in `accept.rs`); a connection over the
//! cap is told "server busy" and closed, never left waiting; one that brings no complete
//! message within `RpcConfig::first_message_timeout` is told why and closed, so silent
//! connections cannot hold the slots for good.

use crate::accept::{self, AcceptFailure, Backoff, RateLimitedLog, SpareFd};
use crate::endpoint::{Endpoint, Registry, RpcConfig};
use crate::error::{Result, RpcError};
use crate::stream::Stream;
use parking_lot::Mutex;
use std::net::TcpListener;
use std::os::fd::AsFd;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

enum L {
    Unix(UnixListener, PathBuf),
    Tcp(TcpListener),
}

/// A listening server. Each accepted connection gets its own [`Endpoint`] on the shared
/// registry; closed connections are pruned.
pub struct Server {
    l: L,
    registry: Registry,
    cfg: RpcConfig,
    conns: Arc<Mutex<Vec<Endpoint>>>,
    spare: Mutex<SpareFd>,
}

impl Server {
    /// Listen on a Unix socket path (must not exist) or `tcp://host:port`.
    pub fn bind(addr: &str, registry: Registry, cfg: RpcConfig) -> Result<Server> {
        let l = if let Some(hp) = addr.strip_prefix("tcp://") {
            L::Tcp(TcpListener::bind(hp).map_err(|e| RpcError::io(&format!("binding {addr}"), e))?)
        } else {
            L::Unix(UnixListener::bind(addr).map_err(|e| RpcError::io(&format!("binding {addr}"), e))?, PathBuf::from(addr))
        };
        Ok(Server { l, registry, cfg, conns: Arc::new(Mutex::new(Vec::new())), spare: Mutex::new(SpareFd::new()) })
    }

    /// The bound address (`tcp://ip:port` for TCP, with the real port).
    pub fn local_addr(&self) -> String {
        match &self.l {
            L::Unix(_, p) => p.display().to_string(),
            L::Tcp(t) => t.local_addr().map(|a| format!("tcp://{a}")).unwrap_or_default(),
        }
    }

    /// Accept one connection and start serving it. Over `RpcConfig::max_connections`
    /// the connection is refused (told why, closed) and this returns
    /// [`RpcError::ConnectionLimit`].
    pub fn accept(&self) -> Result<Endpoint> {
        let s = self.accept_stream().map_err(|e| RpcError::io("accept", e))?;
        self.admit(s)
    }

    fn accept_stream(&self) -> std::io::Result<Stream> {
        Ok(match &self.l {
            L::Unix(l, _) => Stream::Unix(l.accept()?.0),
            L::Tcp(l) => {
                let s = l.accept()?.0;
                let _ = s.set_nodelay(true);
                Stream::Tcp(s)
            }
        })
    }

    /// Serve `s`, or refuse it if the server is at its connection cap.
    fn admit(&self, s: Stream) -> Result<Endpoint> {
        let mut c = self.conns.lock();
        c.retain(|e| !e.is_closed());
        if c.len() >= self.cfg.max_connections {
            let e = RpcError::ConnectionLimit { open: c.len(), cap: self.cfg.max_connections };
            drop(c);
            accept::refuse(s, &e.to_string());
            return Err(e);
        }
        let ep = Endpoint::accepted(s, self.registry.clone(), self.cfg.clone())?;
        c.push(ep.clone());
        Ok(ep)
    }

    /// Accept and serve until the listener itself fails (EBADF, EINVAL, ...). Failed
    /// accepts (out of fds, out of memory, an aborted connection) and connections that
    /// cannot be served are logged to stderr (at most a line a second) and survived.
    pub fn serve_forever(&self) -> Result<()> {
        let mut log = RateLimitedLog::new(format!("tensorwire-rpc server {}", self.local_addr()));
        let mut backoff = Backoff::default();
        loop {
            let e = match self.accept_stream() {
                Ok(s) => {
                    backoff.reset();
                    match self.admit(s) {
                        Ok(_) => {}
                        Err(e @ RpcError::ConnectionLimit { .. }) => log.log(|| format!("refused a connection: {e}")),
                        Err(e) => {
                            // Most likely out of threads or memory: give it a moment.
                            let d = backoff.next_delay();
                            log.log(|| format!("could not serve a connection: {e}; backing off {d:?}"));
                            std::thread::sleep(d);
                        }
                    }
                    continue;
                }
                Err(e) => e,
            };
            match accept::classify(&e) {
                AcceptFailure::Fatal => return Err(RpcError::io("accept", e)),
                // Connections that ended still hold their sockets until pruned, which
                // otherwise happens only when a connection is admitted.
                AcceptFailure::OutOfFds if self.prune() > 0 => {}
                AcceptFailure::OutOfFds if self.refuse_waiting(&e) => {
                    log.log(|| format!("accept failed: {e}; refused the waiting connection and serving on"));
                }
                // A one-off failure (an aborted connection) costs one short pause; one
                // that repeats cannot spin.
                AcceptFailure::OutOfFds | AcceptFailure::Resource | AcceptFailure::Transient => {
                    let d = backoff.next_delay();
                    log.log(|| format!("accept failed: {e}; backing off {d:?} and serving on"));
                    std::thread::sleep(d);
                }
            }
        }
    }

    /// Out of fds: with the spare fd closed, accept the connection that is waiting (if
    /// one still is) and tell it why it is not served. False if there was no spare or
    /// nothing waiting.
    fn refuse_waiting(&self, why: &std::io::Error) -> bool {
        let mut spare = self.spare.lock();
        if !spare.release() {
            spare.restore();
            return false;
        }
        let listener = match &self.l {
            L::Unix(l, _) => l.as_fd(),
            L::Tcp(l) => l.as_fd(),
        };
        let waiting = matches!(tensorwire::os::poll_events(&[(listener, libc::POLLIN)], Some(Duration::ZERO)), Ok(r) if r[0] != 0);
        let refused = waiting
            && match self.accept_stream() {
                Ok(s) => {
                    accept::refuse(s, &format!("server cannot take a connection: it is out of file descriptors ({why}); try again later"));
                    true
                }
                Err(_) => false,
            };
        spare.restore();
        refused
    }

    /// Live connections.
    pub fn connections(&self) -> usize {
        let mut c = self.conns.lock();
        c.retain(|e| !e.is_closed());
        c.len()
    }

    /// Drop connections that have ended (closing their sockets); returns how many.
    fn prune(&self) -> usize {
        let mut c = self.conns.lock();
        let before = c.len();
        c.retain(|e| !e.is_closed());
        before - c.len()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let L::Unix(_, p) = &self.l {
            let _ = std::fs::remove_file(p);
        }
    }
}
