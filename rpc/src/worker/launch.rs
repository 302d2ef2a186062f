//! Starting a worker process: its end of a socketpair inherited (no path to guess), its
//! own process group, death with the supervisor, its resource limits, its output.
//!
//! Every worker is forked by one long-lived thread of this process (the spawner), not by
//! the thread that asked: `PR_SET_PDEATHSIG` fires when the *thread* that forked the child
//! ends, so a worker started by a short-lived thread (a pool's warm-up) would be killed
//! with it.

use super::contain;
use super::output::{self, Captured};
use super::process::Process;
use super::{WorkerSpec, FD_ENV, SANDBOX_ENV};
use crate::{Result, RpcError};
use crossbeam_channel::{bounded, unbounded, Sender};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::sync::OnceLock;

/// A started worker process, before its handshake.
pub(crate) struct Launched {
    pub(crate) child: Process,
    pub(crate) pid: u32,
    /// Readable once the process has ended (`None` where pidfds are not supported).
    pub(crate) pidfd: Option<OwnedFd>,
    /// Our end of the connection.
    pub(crate) conn: OwnedFd,
    pub(crate) captured: Option<Captured>,
    /// `pid` is the keeper of a worker in its own namespaces (the worker is pid 1 there).
    pub(crate) keeper: bool,
}

type Job = Box<dyn FnOnce() + Send>;

/// The spawner thread's queue (started on first use; it lives as long as the process).
fn spawner() -> Result<&'static Sender<Job>> {
    static SPAWNER: OnceLock<std::result::Result<Sender<Job>, String>> = OnceLock::new();
    SPAWNER
        .get_or_init(|| {
            let (tx, rx) = unbounded::<Job>();
            std::thread::Builder::new()
                .name("tensorwire-worker-spawner".into())
                .spawn(move || {
                    for job in rx {
                        job();
                    }
                })
                .map(|_| tx)
                .map_err(|e| format!("starting the worker spawner thread: {e}"))
        })
        .as_ref()
        .map_err(|e| RpcError::Io(e.clone()))
}

/// Start `spec`'s worker: forked from its zygote when the spec has one (a zygote that
/// cannot give one is said on stderr, and the worker is exec'd instead), else its program
/// exec'd.
pub(crate) fn launch_worker(spec: &WorkerSpec) -> Result<Launched> {
    if let Some(z) = &spec.zygote {
        match z.launch(spec) {
            Ok(l) => return Ok(l),
            // A machine that cannot give the sandbox cannot exec one either.
            Err(e @ RpcError::Unsupported(_)) => return Err(e),
            Err(e) => eprintln!("tensorwire: starting worker {} by exec instead of from its zygote: {e}", spec.program.display()),
        }
    }
    launch(spec)
}

/// Start `spec`'s program (on the spawner thread) and take its output.
pub(crate) fn launch(spec: &WorkerSpec) -> Result<Launched> {
    let (ours, theirs) = UnixStream::pair().map_err(|e| RpcError::io("socketpair for a worker", e))?;
    let (theirs, ours): (OwnedFd, OwnedFd) = (theirs.into(), ours.into());
    let mut cmd = Command::new(&spec.program);
    cmd.args(&spec.args).stdin(Stdio::null());
    for (k, v) in &spec.env {
        cmd.env(k, v);
    }
    if let Some(dir) = &spec.cwd {
        cmd.current_dir(dir);
    }
    let (out, err) = output::stdio(&spec.output);
    cmd.stdout(out).stderr(err);
    let fd = tensorwire::os::inherit_in_child(&mut cmd, theirs.as_fd());
    cmd.env(FD_ENV, fd.to_string());
    match &spec.sandbox {
        Some(s) => cmd.env(SANDBOX_ENV, s.to_json()),
        None => cmd.env_remove(SANDBOX_ENV),
    };
    if spec.clean_env {
        contain::restrict_environment(&mut cmd);
    }
    // SAFETY: getpid has no preconditions.
    let parent = unsafe { libc::getpid() };
    let limits = [
        (libc::RLIMIT_AS, spec.limits.address_space),
        (libc::RLIMIT_NOFILE, spec.limits.open_files),
        (libc::RLIMIT_CPU, spec.limits.cpu_seconds),
    ];
    // SAFETY: the closure runs in the forked child before exec and calls only setpgid,
    // prctl, getppid, setrlimit and _exit, all async-signal-safe; it allocates nothing
    // (the limits are copied in as plain integers).
    unsafe {
        cmd.pre_exec(move || {
            // Its own process group: the supervisor kills the worker with whatever it
            // started (`killpg`).
            if libc::setpgid(0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // SIGKILL when the spawner thread (which lives as long as the supervisor
            // process) ends.
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The supervisor died between fork and prctl: the signal will never come.
            if libc::getppid() != parent {
                libc::_exit(127);
            }
            for (resource, limit) in limits {
                if let Some(v) = limit {
                    let r = libc::rlimit { rlim_cur: v as libc::rlim_t, rlim_max: v as libc::rlim_t };
                    if libc::setrlimit(resource, &r) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
            }
            Ok(())
        });
    }
    // Last: its closures run after the ones above, in the keeper and then in the worker.
    let keeper = match &spec.sandbox {
        Some(s) => {
            contain::contain(&mut cmd, contain::prepare(s, &spec.program)?, fd);
            s.namespaces
        }
        None => false,
    };
    let (tx, rx) = bounded(1);
    spawner()?
        .send(Box::new(move || {
            let _ = tx.send(cmd.spawn());
        }))
        .map_err(|_| RpcError::Io("the worker spawner thread is gone".into()))?;
    let spawned = rx.recv().map_err(|_| RpcError::Io("the worker spawner thread is gone".into()))?;
    let mut child = spawned.map_err(|e| RpcError::io(&format!("starting worker {}", spec.program.display()), e))?;
    drop(theirs);
    let pid = child.id();
    let pidfd = tensorwire::os::pidfd_open(pid as libc::pid_t);
    let captured = output::attach(&mut child, &spec.output, pid);
    Ok(Launched { child: Process::Spawned(child), pid, pidfd, conn: ours, captured, keeper })
}
