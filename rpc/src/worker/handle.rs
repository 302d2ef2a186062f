//! `Worker`: one supervised worker process and the connection to it, replaced by a fresh
//! one when it dies or is killed.

use super::launch::{launch_worker, Launched};
use super::process::Process;
use super::{Captured, WorkerSpec, CONTROL_ID};
use crate::{CallOptions, Endpoint, Map, Result, RpcError, Value};
use parking_lot::Mutex;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tensorwire::os::{pidfd_process_end, signal_name, ProcessEnd};
use tensorwire::Wait;

/// Where a worker stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WorkerState {
    /// A process is running and answered its handshake.
    Ready { pid: u32 },
    /// No process: none started yet, or the last one ended (`why`); the next call starts
    /// a fresh one.
    Down { why: String },
}

/// One running worker process.
struct Live {
    pid: u32,
    /// `pid` is the keeper of a worker in its own namespaces (see `contain/keeper.rs`).
    keeper: bool,
    child: Mutex<Process>,
    pidfd: Option<OwnedFd>,
    endpoint: Endpoint,
    captured: Option<Captured>,
    /// Calls in flight on it.
    calls: AtomicUsize,
    /// Set once it was killed, died or broke the protocol: it must not serve again.
    spoiled: AtomicBool,
}

/// A supervised worker: calls go to its current process, which is started on demand and
/// replaced after it dies or is killed. Dropping it ends the process (a clean close, then
/// SIGKILL to its process group after a grace period).
pub struct Worker {
    spec: WorkerSpec,
    live: Mutex<Option<Arc<Live>>>,
    last_end: Mutex<String>,
}

/// How long a closing worker may take to exit after its connection is closed.
const CLOSE_GRACE: Duration = Duration::from_secs(2);
/// How long a worker whose connection ended may take to be seen ended by its pidfd.
const EXIT_GRACE: Duration = Duration::from_millis(200);

impl Worker {
    /// Start a worker as `spec` says and wait for its handshake.
    pub(crate) fn start(spec: WorkerSpec) -> Result<Worker> {
        let w = Worker { spec, live: Mutex::new(None), last_end: Mutex::new("not started".into()) };
        w.current()?;
        Ok(w)
    }

    /// The spec it was started from.
    pub fn spec(&self) -> &WorkerSpec {
        &self.spec
    }

    pub fn state(&self) -> WorkerState {
        match &*self.live.lock() {
            Some(l) if !l.spoiled.load(Ordering::Acquire) => WorkerState::Ready { pid: l.pid },
            _ => WorkerState::Down { why: self.last_end.lock().clone() },
        }
    }

    /// The pid of the running process, if one runs.
    pub fn pid(&self) -> Option<u32> {
        match self.state() {
            WorkerState::Ready { pid } => Some(pid),
            WorkerState::Down { .. } => None,
        }
    }

    /// What the running (or last) process wrote, when started with `Output::Capture`.
    pub fn output(&self) -> Option<Captured> {
        self.live.lock().as_ref().and_then(|l| l.captured.clone())
    }

    /// The connection to the running process (starting one if none runs): for callbacks,
    /// native tensor set-up, or anything else an `Endpoint` does.
    pub fn endpoint(&self) -> Result<Endpoint> {
        Ok(self.current()?.endpoint.clone())
    }

    /// Call `object.method(*args)` in the worker under the spec's call deadline.
    pub fn call(&self, object: &str, method: &str, args: Vec<Value>) -> Result<Value> {
        self.call_with(object, method, args, Map::new(), self.spec.call_timeout)
    }

    /// Call with keyword arguments and a deadline (`None`: the spec's). Past the deadline
    /// the worker's process group is killed and the call fails with `Timeout`; a worker
    /// that dies during the call fails it with `PeerGone` naming how it ended. Either way
    /// the next call gets a fresh worker.
    pub fn call_with(&self, object: &str, method: &str, args: Vec<Value>, kwargs: Map, deadline: Option<Duration>) -> Result<Value> {
        let live = self.current()?;
        live.calls.fetch_add(1, Ordering::AcqRel);
        let timeout = deadline.or(self.spec.call_timeout).map(Wait::from).unwrap_or(Wait::Forever);
        let r = live.endpoint.call_with(object, method, args, kwargs, CallOptions { timeout: Some(timeout), parent_call_id: None });
        live.calls.fetch_sub(1, Ordering::AcqRel);
        match r {
            Err(RpcError::Timeout { after, .. }) => {
                let what = format!("{object}.{method} in worker {} (killed at its deadline)", live.pid);
                self.end(&live, &format!("killed: a call to {object}.{method} passed its deadline of {after:?}"));
                Err(RpcError::Timeout { what, after })
            }
            // The connection ended under the call (the worker died, or broke the protocol
            // and was cut off): the worker cannot serve again.
            Err(e) if live.endpoint.is_closed() => {
                let how = self.end(&live, &format!("killed: its connection failed: {e}"));
                Err(match e {
                    RpcError::PeerGone(_) => RpcError::PeerGone(format!("worker {} {how}", live.pid)),
                    other => other,
                })
            }
            r => r,
        }
    }

    /// Whether the worker can serve again as it is: it runs, nothing is in flight, and it
    /// was never killed or broken (a pool reuses only such workers).
    pub fn is_clean(&self) -> bool {
        match &*self.live.lock() {
            Some(l) => !l.spoiled.load(Ordering::Acquire) && l.calls.load(Ordering::Acquire) == 0 && !process_ended(l),
            None => false,
        }
    }

    /// Kill the running process (its whole process group) now and reap it.
    pub fn kill(&self) {
        if let Some(l) = self.live.lock().clone() {
            self.end(&l, "killed by its supervisor");
        }
    }

    /// The running process, or a fresh one after its handshake.
    fn current(&self) -> Result<Arc<Live>> {
        let mut slot = self.live.lock();
        if let Some(l) = slot.as_ref() {
            if !l.spoiled.load(Ordering::Acquire) && !process_ended(l) {
                return Ok(l.clone());
            }
            if !l.spoiled.swap(true, Ordering::AcqRel) {
                *self.last_end.lock() = reap(l, "it ended");
            }
        }
        let live = Arc::new(self.handshake(launch_worker(&self.spec)?)?);
        *slot = Some(live.clone());
        Ok(live)
    }

    /// Connect to a launched process and wait for its hello (and native tensors, when
    /// the spec asks for them) within the handshake time-out; a process that fails it is
    /// killed and reaped, and the error says how it ended.
    fn handshake(&self, l: Launched) -> Result<Live> {
        let Launched { child, pid, pidfd, conn, captured, keeper } = l;
        let by = Instant::now() + self.spec.handshake_timeout;
        let mut child = child;
        let endpoint = match Endpoint::from_fd(conn, self.spec.registry.clone(), self.spec.rpc.clone()) {
            Ok(e) => e,
            Err(e) => {
                // SAFETY: signals the process group the worker (or its keeper) leads
                // (see `kill_and_reap`).
                unsafe { libc::kill(-(pid as libc::pid_t), libc::SIGKILL) };
                let _ = child.wait();
                return Err(e);
            }
        };
        let l = Live { pid, keeper, child: Mutex::new(child), pidfd, endpoint, captured, calls: AtomicUsize::new(0), spoiled: AtomicBool::new(false) };
        // A worker in its own pid namespace is pid 1 there: answering so proves it.
        let expected = if keeper { 1 } else { i64::from(pid) };
        let hello = l.endpoint.call_with(CONTROL_ID, "hello", vec![], Map::new(), CallOptions { timeout: Some(by.into()), parent_call_id: None });
        let r = hello.and_then(|v| match v.get("pid").and_then(Value::as_i64) {
            Some(p) if p == expected => Ok(()),
            _ => Err(RpcError::Protocol(format!("worker {pid} answered its handshake with {v:?}, not its pid ({expected})"))),
        });
        let r = r.and_then(|()| if self.spec.native { l.endpoint.negotiate_native(by).map(drop) } else { Ok(()) });
        match r {
            Ok(()) => Ok(l),
            Err(e) => {
                let how = reap(&l, "closed its connection (then killed)");
                let tail = l.captured.as_ref().map(|c| String::from_utf8_lossy(&c.stderr()).trim_end().to_string()).unwrap_or_default();
                let tail = if tail.is_empty() { String::new() } else { format!("; its stderr ends with:\n{tail}") };
                Err(match e {
                    RpcError::Timeout { after, .. } => RpcError::Timeout { what: format!("the handshake of worker {pid} (killed){tail}"), after },
                    RpcError::PeerGone(_) => RpcError::PeerGone(format!("worker {pid} {how} before its handshake{tail}")),
                    other => other,
                })
            }
        }
    }

    /// Retire `l` (if it is still the current process): kill its group, reap it, and say
    /// how it ended.
    fn end(&self, l: &Arc<Live>, why: &str) -> String {
        if l.spoiled.swap(true, Ordering::AcqRel) {
            return self.last_end.lock().clone();
        }
        let how = reap(l, why);
        *self.last_end.lock() = how.clone();
        how
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        if let Some(l) = self.live.lock().take() {
            if !l.spoiled.swap(true, Ordering::AcqRel) {
                l.endpoint.close(CLOSE_GRACE);
                if !wait_ended_no_reap(&l, CLOSE_GRACE) {
                    kill_and_reap(&l);
                } else {
                    end_group_and_reap(&l);
                }
            }
        }
    }
}

fn process_ended(l: &Live) -> bool {
    l.pidfd.as_ref().is_some_and(|p| pidfd_process_end(p.as_fd()) != ProcessEnd::Running)
}

/// Wait up to `within` for the process to end on its own.
fn wait_ended(l: &Live, within: Duration) -> bool {
    let by = Instant::now() + within;
    loop {
        if let Ok(Some(_)) = l.child.lock().try_wait() {
            return true;
        }
        if Instant::now() >= by {
            return false;
        }
        match &l.pidfd {
            Some(p) => {
                let _ = tensorwire::os::poll_events(&[(p.as_fd(), libc::POLLIN)], Some(by.saturating_duration_since(Instant::now())));
            }
            None => std::thread::sleep(Duration::from_millis(5)),
        }
    }
}

/// Wait up to `within` for the pidfd to say the process ended, without reaping it (its
/// status stays for `reap` to read); whether it ended (without a pidfd: after polling
/// its status without reaping).
fn wait_ended_no_reap(l: &Live, within: Duration) -> bool {
    match &l.pidfd {
        Some(p) => {
            let _ = tensorwire::os::poll_events(&[(p.as_fd(), libc::POLLIN)], Some(within));
            pidfd_process_end(p.as_fd()) != ProcessEnd::Running
        }
        None => wait_ended(l, within),
    }
}

/// How long a keeper may take to end its worker's namespace after `SIGTERM`.
const KEEPER_GRACE: Duration = Duration::from_secs(2);

/// End the worker and everything it started, then reap. A worker in its own namespaces:
/// `SIGTERM` to its keeper, which SIGKILLs pid 1 and exits once the kernel has ended every
/// process of the namespace (so nothing is left when this returns); SIGKILL to the group
/// if the keeper does not end in time. Otherwise SIGKILL to the process group.
fn kill_and_reap(l: &Live) -> Option<std::process::ExitStatus> {
    if l.keeper {
        // SAFETY: the keeper is our child and not yet reaped, so `pid` still names it.
        unsafe { libc::kill(l.pid as libc::pid_t, libc::SIGTERM) };
        if wait_ended_no_reap(l, KEEPER_GRACE) {
            l.endpoint.close(Wait::Never);
            return l.child.lock().wait().ok();
        }
    }
    l.endpoint.close(Wait::Never);
    end_group_and_reap(l)
}

/// SIGKILL to the process group (what the worker started and left in it, also after the
/// worker itself ended), then reap. The leader is not reaped before the signal, so its
/// pid, which is the group's id, cannot have been reused.
fn end_group_and_reap(l: &Live) -> Option<std::process::ExitStatus> {
    // SAFETY: kill with a negative pid signals the process group the worker (or its
    // keeper) leads (setpgid(0, 0) before exec); a group already gone is ESRCH, ignored.
    unsafe { libc::kill(-(l.pid as libc::pid_t), libc::SIGKILL) };
    l.child.lock().wait().ok()
}

/// Kill (if it still runs), reap, and describe how the process ended ("was killed by
/// SIGSEGV", "exited with status 3"), after `why` when we killed it.
fn reap(l: &Live, why: &str) -> String {
    // A worker that closed its connection by dying is seen ended a moment after its
    // socket closed (its files close before its exit is signalled): give it that moment
    // before deciding it still runs.
    if l.endpoint.is_closed() {
        let _ = wait_ended_no_reap(l, EXIT_GRACE);
    }
    let ended_alone = match &l.pidfd {
        Some(p) => match pidfd_process_end(p.as_fd()) {
            ProcessEnd::Running => None,
            end => Some(end),
        },
        None => None,
    };
    match ended_alone {
        Some(end) => {
            l.endpoint.close(Wait::Never);
            end_group_and_reap(l);
            match end {
                ProcessEnd::Exited(code) => format!("exited with status {code}"),
                ProcessEnd::Killed { signal, core } => {
                    format!("was killed by {}{}", signal_name(signal), if core { " (core dumped)" } else { "" })
                }
                ProcessEnd::Ended | ProcessEnd::Running => "ended".into(),
            }
        }
        None => {
            kill_and_reap(l);
            why.to_string()
        }
    }
}
