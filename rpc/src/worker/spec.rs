//! What a worker is started as: program, environment, output, limits, sandbox, and the
//! time-outs the supervisor holds it to.

use super::zygote::Zygote;
use super::{Sandbox, Worker};
use crate::{Registry, Result, RpcConfig};
use std::ffi::OsString;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// Where a worker's stdout and stderr go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Output {
    /// The same as this process's.
    Inherit,
    /// Line by line to this process's stdout / stderr, each line after this prefix (e.g.
    /// `"[worker 3] "`), so many workers' output stays readable.
    Prefixed(String),
    /// Kept for the supervisor ([`Worker::output`]): the last `max_bytes` of each stream.
    Capture { max_bytes: usize },
}

/// Resource limits set in the child before it runs (`setrlimit`, soft and hard); `None`
/// leaves this process's limit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Limits {
    /// `RLIMIT_AS`: bytes of address space.
    pub address_space: Option<u64>,
    /// `RLIMIT_NOFILE`: open files.
    pub open_files: Option<u64>,
    /// `RLIMIT_CPU`: seconds of CPU time (then SIGKILL).
    pub cpu_seconds: Option<u64>,
}

/// How to start a worker (a builder; cloned into each worker a pool or a respawn starts).
#[derive(Clone)]
pub struct WorkerSpec {
    pub(crate) program: PathBuf,
    pub(crate) args: Vec<OsString>,
    pub(crate) env: Vec<(OsString, OsString)>,
    pub(crate) cwd: Option<PathBuf>,
    pub(crate) output: Output,
    pub(crate) limits: Limits,
    pub(crate) sandbox: Option<Sandbox>,
    pub(crate) handshake_timeout: Duration,
    pub(crate) call_timeout: Option<Duration>,
    pub(crate) registry: Registry,
    pub(crate) rpc: RpcConfig,
    pub(crate) native: bool,
    /// Shared by every clone of the spec (a pool's workers, replacements).
    pub(crate) zygote: Option<Arc<Zygote>>,
    /// Start with only the allow-listed environment (a sandboxed spec's zygote).
    pub(crate) clean_env: bool,
}

/// The handshake's default: it includes the child's start-up, and a Python child imports
/// torch first (seconds, more on a busy machine with a cold page cache).
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(60);

impl WorkerSpec {
    /// Run `program` (found on `PATH` when it has no `/`).
    pub fn new(program: impl Into<PathBuf>) -> WorkerSpec {
        WorkerSpec {
            program: program.into(),
            args: Vec::new(),
            env: Vec::new(),
            cwd: None,
            output: Output::Inherit,
            limits: Limits::default(),
            sandbox: None,
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
            call_timeout: None,
            registry: Registry::new(),
            rpc: RpcConfig::default(),
            native: true,
            zygote: None,
            clean_env: false,
        }
    }

    pub fn arg(mut self, a: impl Into<OsString>) -> Self {
        self.args.push(a.into());
        self
    }

    pub fn args<I: IntoIterator<Item = S>, S: Into<OsString>>(mut self, args: I) -> Self {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    /// Set an environment variable for the child (the rest is inherited).
    pub fn env(mut self, key: impl Into<OsString>, value: impl Into<OsString>) -> Self {
        self.env.push((key.into(), value.into()));
        self
    }

    pub fn current_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.cwd = Some(dir.into());
        self
    }

    pub fn output(mut self, output: Output) -> Self {
        self.output = output;
        self
    }

    pub fn limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }

    /// The sandbox the child applies to itself before it answers the handshake.
    pub fn sandbox(mut self, sandbox: Sandbox) -> Self {
        self.sandbox = Some(sandbox);
        self
    }

    /// How long the child may take to start and answer (default 60 s).
    pub fn handshake_timeout(mut self, t: Duration) -> Self {
        self.handshake_timeout = t;
        self
    }

    /// The deadline of every call that names none (default: none). A call past its
    /// deadline kills the worker.
    pub fn call_timeout(mut self, t: Duration) -> Self {
        self.call_timeout = Some(t);
        self
    }

    /// What this side serves to the worker (its callbacks into us).
    pub fn registry(mut self, registry: Registry) -> Self {
        self.registry = registry;
        self
    }

    pub fn rpc_config(mut self, cfg: RpcConfig) -> Self {
        self.rpc = cfg;
        self
    }

    /// Whether tensors travel natively (leased memfd segments, CUDA IPC) once the worker
    /// answered (default true).
    pub fn native_tensors(mut self, on: bool) -> Self {
        self.native = on;
        self
    }

    /// Fork this spec's workers from a zygote: a process of this spec's program started
    /// with `zygote_args` (not the spec's arguments) that serves the zygote protocol
    /// (`docs/DESIGN.md`, "The zygote"; Python's is `python -P -m tensorwire.zygote`),
    /// started on the first worker and shared by every clone of this spec. Each request
    /// carries the spec's arguments, and the zygote's fork serves them as the exec'd
    /// program would. The zygote is trusted code and gets the spec's environment and
    /// directory, never its sandbox; a sandboxed spec's zygote starts with the
    /// allow-listed environment only, and each worker it forks is contained as an exec'd
    /// one is (keeper, namespaces, landlock, then the system-call policy). A zygote that
    /// cannot give a worker (it died while starting, answered wrongly) is ended, the
    /// worker is exec'd (said on stderr), and the next start starts a fresh zygote.
    pub fn zygote<I: IntoIterator<Item = S>, S: Into<OsString>>(mut self, zygote_args: I) -> Self {
        self.zygote = Some(Arc::new(Zygote::new(zygote_args.into_iter().map(Into::into).collect())));
        self
    }

    /// The zygote's pid while one runs for this spec.
    pub fn zygote_pid(&self) -> Option<u32> {
        self.zygote.as_ref().and_then(|z| z.pid())
    }

    /// Start one worker and wait for its handshake.
    pub fn spawn(&self) -> Result<Worker> {
        Worker::start(self.clone())
    }
}
