//! What a sandboxed worker may still do (`Sandbox`), as the supervisor asks for it and
//! the worker reads it back (JSON in `SANDBOX_ENV`). How it is enforced is `contain/`.

use crate::{Result, RpcError};
use serde_json::json;
use std::path::PathBuf;

/// What a sandboxed worker may still do. Every level of `docs/DESIGN.md`'s containment
/// table applies unless a field here relaxes it; a level the machine cannot give makes
/// the spawn fail with `RpcError::Unsupported` naming it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sandbox {
    /// Paths (each with everything below it) the worker may read and execute from, on
    /// top of the program and the system's libraries; every other path is denied. A
    /// Python worker needs its interpreter's prefix, site-packages and import path here
    /// (`tensorwire.spawn` adds them).
    pub read: Vec<PathBuf>,
    /// Paths (each with everything below it) the worker may also write, create and
    /// remove in (a scratch directory; `/dev/nvidia*` for a CUDA worker).
    pub write: Vec<PathBuf>,
    /// Refuse `socket()` for every family (the worker has its connection; `socketpair`
    /// stays), TCP bind and connect (landlock) and `io_uring`.
    pub deny_network: bool,
    /// Refuse `execve` / `execveat`.
    pub deny_exec: bool,
    /// Own user, pid, network, IPC, UTS and cgroup namespaces (the worker is pid 1 of its
    /// own: it can name no process of the host, and everything it starts ends with it).
    /// Only set this to false on a machine that refuses user namespaces, knowing that
    /// the worker's descendants then end only with its process group.
    pub namespaces: bool,
    /// A GPU worker: the NVIDIA device files (read, write, their ioctls), what the driver
    /// reads as it starts, and the driver library's directory become reachable. CUDA
    /// memory crosses the pid namespace by VMM fd (cudaMalloc memory as a copy).
    pub gpu: bool,
}

impl Default for Sandbox {
    /// Nothing readable or writable beyond the program and the system's libraries, no
    /// network, no exec, own namespaces: add what the worker needs.
    fn default() -> Self {
        Sandbox { read: Vec::new(), write: Vec::new(), deny_network: true, deny_exec: true, namespaces: true, gpu: false }
    }
}

impl Sandbox {
    pub(crate) fn to_json(&self) -> String {
        let paths = |v: &[PathBuf]| v.iter().map(|p| p.to_string_lossy().into_owned()).collect::<Vec<_>>();
        json!({"read": paths(&self.read), "write": paths(&self.write), "deny_network": self.deny_network,
               "deny_exec": self.deny_exec, "namespaces": self.namespaces, "gpu": self.gpu})
        .to_string()
    }

    pub(crate) fn from_json(text: &str) -> Result<Sandbox> {
        let bad = |why: &str| RpcError::InvalidArgument(format!("{}: {why}", super::SANDBOX_ENV));
        let v: serde_json::Value = serde_json::from_str(text).map_err(|e| bad(&e.to_string()))?;
        let paths = |key: &str| -> Result<Vec<PathBuf>> {
            v.get(key)
                .and_then(|a| a.as_array())
                .ok_or_else(|| bad(&format!("`{key}` is not a list")))?
                .iter()
                .map(|p| p.as_str().map(PathBuf::from).ok_or_else(|| bad(&format!("`{key}` holds a non-string"))))
                .collect()
        };
        let flag = |key: &str| v.get(key).and_then(|b| b.as_bool()).ok_or_else(|| bad(&format!("`{key}` is not a bool")));
        Ok(Sandbox {
            read: paths("read")?,
            write: paths("write")?,
            deny_network: flag("deny_network")?,
            deny_exec: flag("deny_exec")?,
            namespaces: flag("namespaces")?,
            gpu: flag("gpu")?,
        })
    }
}
