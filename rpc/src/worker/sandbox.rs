//! The sandbox a worker applies to itself before it serves: no new privileges, a file
//! system allow-list (landlock), and no network sockets and no exec (seccomp).
//!
//! Applied by the child ([`Sandbox::apply`], called by `worker::serve` from what the
//! supervisor put in `SANDBOX_ENV`), after its start-up and before the code it serves
//! runs: the interpreter had to be exec'd and its libraries read first, and seccomp's exec
//! ban could not let the child start at all if applied before exec. What the sandbox
//! leaves working is what tensors need: memfds (no path), `mmap`, `SCM_RIGHTS` on the
//! inherited Unix socket, futexes, `AF_UNIX` sockets.

use crate::{Result, RpcError};
use landlock::{
    path_beneath_rules, Access, AccessFs, CompatLevel, Compatible, Ruleset, RulesetAttr, RulesetCreatedAttr, RulesetStatus,
    ABI,
};
use seccompiler::{SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter, SeccompRule};
use serde_json::json;
use std::collections::BTreeMap;
use std::path::PathBuf;

/// What a sandboxed worker may still do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sandbox {
    /// Paths (each with everything below it) the worker may read and execute from; every
    /// other path is denied. A Python worker needs its interpreter's prefix and
    /// site-packages here (`tensorwire.spawn` adds them).
    pub read: Vec<PathBuf>,
    /// Paths (each with everything below it) the worker may also write, create and
    /// remove in (a scratch directory; `/dev` for a CUDA worker).
    pub write: Vec<PathBuf>,
    /// Refuse `socket()` for every family but `AF_UNIX` (and `io_uring`, which could open
    /// one past the filter) with `EPERM`.
    pub deny_network: bool,
    /// Refuse `execve` / `execveat` with `EPERM`.
    pub deny_exec: bool,
}

impl Default for Sandbox {
    /// Nothing readable or writable, no network, no exec: add what the worker needs.
    fn default() -> Self {
        Sandbox { read: Vec::new(), write: Vec::new(), deny_network: true, deny_exec: true }
    }
}

/// The landlock ABI whose file-system rights the allow-list covers (Linux 6.2: read,
/// write, execute, make/remove, refer, truncate). Newer rights (device ioctls) stay
/// allowed, so a CUDA worker's driver keeps working.
const FS_ABI: ABI = ABI::V3;

impl Sandbox {
    pub(crate) fn to_json(&self) -> String {
        let paths = |v: &[PathBuf]| v.iter().map(|p| p.to_string_lossy().into_owned()).collect::<Vec<_>>();
        json!({"read": paths(&self.read), "write": paths(&self.write), "deny_network": self.deny_network, "deny_exec": self.deny_exec})
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
        Ok(Sandbox { read: paths("read")?, write: paths("write")?, deny_network: flag("deny_network")?, deny_exec: flag("deny_exec")? })
    }

    /// Restrict this process (every thread) for the rest of its life. Fails — and then
    /// nothing is half-applied that the caller could mistake for a sandbox — when the
    /// kernel cannot enforce the file-system allow-list (no landlock) or refuses the
    /// seccomp filter.
    pub fn apply(&self) -> Result<()> {
        // SAFETY: prctl with integer arguments; PR_SET_NO_NEW_PRIVS only ever restricts.
        if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
            return Err(RpcError::io("prctl(PR_SET_NO_NEW_PRIVS)", std::io::Error::last_os_error()));
        }
        self.restrict_paths()?;
        self.filter_syscalls()
    }

    fn restrict_paths(&self) -> Result<()> {
        let fail = |e: &dyn std::fmt::Display| RpcError::Io(format!("sandbox: landlock: {e}"));
        let status = Ruleset::default()
            .set_compatibility(CompatLevel::BestEffort)
            .handle_access(AccessFs::from_all(FS_ABI))
            .map_err(|e| fail(&e))?
            .create()
            .map_err(|e| fail(&e))?
            .add_rules(path_beneath_rules(&self.read, AccessFs::from_read(FS_ABI)))
            .map_err(|e| fail(&e))?
            .add_rules(path_beneath_rules(&self.write, AccessFs::from_all(FS_ABI)))
            .map_err(|e| fail(&e))?
            .restrict_self()
            .map_err(|e| fail(&e))?;
        if status.ruleset == RulesetStatus::NotEnforced {
            return Err(RpcError::Io(
                "sandbox: this kernel cannot enforce a file-system allow-list (landlock is not available); the worker was not started unsandboxed".into(),
            ));
        }
        Ok(())
    }

    fn filter_syscalls(&self) -> Result<()> {
        let fail = |e: &dyn std::fmt::Display| RpcError::Io(format!("sandbox: seccomp: {e}"));
        let mut rules: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
        if self.deny_network {
            let not_unix = SeccompCondition::new(0, SeccompCmpArgLen::Dword, SeccompCmpOp::Ne, libc::AF_UNIX as u64).map_err(|e| fail(&e))?;
            rules.insert(libc::SYS_socket, vec![SeccompRule::new(vec![not_unix]).map_err(|e| fail(&e))?]);
            rules.insert(libc::SYS_io_uring_setup, Vec::new());
        }
        if self.deny_exec {
            rules.insert(libc::SYS_execve, Vec::new());
            rules.insert(libc::SYS_execveat, Vec::new());
        }
        if rules.is_empty() {
            return Ok(());
        }
        let arch = std::env::consts::ARCH.try_into().map_err(|e| fail(&e))?;
        let filter = SeccompFilter::new(rules, SeccompAction::Allow, SeccompAction::Errno(libc::EPERM as u32), arch).map_err(|e| fail(&e))?;
        let program: seccompiler::BpfProgram = filter.try_into().map_err(|e: seccompiler::BackendError| fail(&e))?;
        seccompiler::apply_filter_all_threads(&program).map_err(|e| fail(&e))
    }
}
