//! Accept loop: serve a [`Registry`] to every peer that connects to a Unix socket path
//! (or a TCP address).

use crate::endpoint::{Endpoint, RpcConfig};
use crate::error::{Result, RpcError};
use crate::service::Registry;
use crate::stream::Stream;
use parking_lot::Mutex;
use std::net::TcpListener;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::Arc;

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
}

impl Server {
    /// Listen on a Unix socket path (must not exist) or `tcp://host:port`.
    pub fn bind(addr: &str, registry: Registry, cfg: RpcConfig) -> Result<Server> {
        let l = if let Some(hp) = addr.strip_prefix("tcp://") {
            L::Tcp(TcpListener::bind(hp).map_err(|e| RpcError::io(&format!("binding {addr}"), e))?)
        } else {
            L::Unix(UnixListener::bind(addr).map_err(|e| RpcError::io(&format!("binding {addr}"), e))?, PathBuf::from(addr))
        };
        Ok(Server { l, registry, cfg, conns: Arc::new(Mutex::new(Vec::new())) })
    }

    /// The bound address (`tcp://ip:port` for TCP, with the real port).
    pub fn local_addr(&self) -> String {
        match &self.l {
            L::Unix(_, p) => p.display().to_string(),
            L::Tcp(t) => t.local_addr().map(|a| format!("tcp://{a}")).unwrap_or_default(),
        }
    }

    /// Accept one connection and start serving it.
    pub fn accept(&self) -> Result<Endpoint> {
        let s = match &self.l {
            L::Unix(l, _) => Stream::Unix(l.accept().map_err(|e| RpcError::io("accept", e))?.0),
            L::Tcp(l) => {
                let s = l.accept().map_err(|e| RpcError::io("accept", e))?.0;
                let _ = s.set_nodelay(true);
                Stream::Tcp(s)
            }
        };
        let ep = Endpoint::new(s, self.registry.clone(), self.cfg.clone())?;
        let mut c = self.conns.lock();
        c.retain(|e| !e.is_closed());
        c.push(ep.clone());
        Ok(ep)
    }

    /// Accept and serve until an accept fails.
    pub fn serve_forever(&self) -> Result<()> {
        loop {
            self.accept()?;
        }
    }

    /// Live connections.
    pub fn connections(&self) -> usize {
        let mut c = self.conns.lock();
        c.retain(|e| !e.is_closed());
        c.len()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let L::Unix(_, p) = &self.l {
            let _ = std::fs::remove_file(p);
        }
    }
}
