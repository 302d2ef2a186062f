//! `Worker`: one supervised worker process and the connection to it, replaced by a fresh
//! one when it dies or is killed.

use super::launch::{launch_worker, Launched};
use super::process::Process;
use super::{Captured, WorkerSpec, CONTROL_ID};
use crate::{CallOptions, Endpoint, Map, Result, RpcError, Value};
use crate::{Canceller, PendingCall};
use parking_lot::{Condvar, Mutex};
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
    /// Set once a call on it was abandoned: it may still be running that call's handler,
    /// so a pool does not hand it out again.
    abandoned: AtomicBool,
}

/// A supervised worker: calls go to its current process, which is started on demand and
/// replaced after it dies or is killed. Dropping it ends the process (a clean close, then
/// SIGKILL to its process group after a grace period).
pub struct Worker {
    spec: WorkerSpec,
    live: Mutex<Option<Arc<Live>>>,
    last_end: Mutex<String>,
    /// The process started in the background to replace one that was killed or died
    /// under a call.
    next: Arc<Replacement>,
    /// Whether a process that was killed or died under a call is replaced in the
    /// background at once (a pool's workers are not: the pool replaces them).
    replace: AtomicBool,
}

/// A replacement process being started in the background, or started and not yet taken.
#[derive(Default)]
struct Replacement {
    state: Mutex<NextStart>,
    done: Condvar,
}

#[derive(Default)]
struct NextStart {
    running: bool,
    /// The finished start: a `Worker` whose process the next call (or `state`) adopts.
    started: Option<Result<Worker>>,
    /// The `Worker` was dropped: a start that finishes now is ended at once.
    closed: bool,
}

/// What cancelling a call ([`Worker::cancel_call`]) does to the worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnInterrupt {
    /// Kill the process (every call in flight on it fails) and start its replacement in
    /// the background: the only way to stop a handler in the middle.
    #[default]
    Kill,
    /// Drop the call (its answer is discarded when it comes); the process keeps running
    /// it. A pool does not hand out a worker with an abandoned call again.
    Abandon,
}

/// A call started on a worker ([`Worker::start_call`]): wait for it in slices with
/// [`Worker::wait_call`], or cancel it with [`Worker::cancel_call`] — on the worker that
/// started it.
pub struct WorkerCall {
    live: Arc<Live>,
    pending: Option<PendingCall>,
    /// When the call's deadline passes (`None`: no deadline), and the deadline asked for.
    by: Option<Instant>,
    after: Duration,
    object: String,
    method: String,
}

impl WorkerCall {
    /// Cancels the call from any thread at the connection (its wait then returns
    /// `Cancelled`), without the policy [`Worker::cancel_call`] applies; `None` once it is
    /// over.
    pub fn canceller(&self) -> Option<Canceller> {
        self.pending.as_ref().map(PendingCall::canceller)
    }
}

impl Drop for WorkerCall {
    fn drop(&mut self) {
        // Counted in `start_call`; a call is in flight until its handle goes.
        self.live.calls.fetch_sub(1, Ordering::AcqRel);
    }
}

/// How long a closing worker may take to exit after its connection is closed.
const CLOSE_GRACE: Duration = Duration::from_secs(2);
/// How long a worker whose connection ended may take to be seen ended by its pidfd.
const EXIT_GRACE: Duration = Duration::from_millis(200);

impl Worker {
    /// Start a worker as `spec` says and wait for its handshake.
    pub(crate) fn start(spec: WorkerSpec) -> Result<Worker> {
        let w = Worker {
            spec,
            live: Mutex::new(None),
            last_end: Mutex::new("not started".into()),
            next: Arc::default(),
            replace: AtomicBool::new(true),
        };
        w.current()?;
        Ok(w)
    }

    /// The spec it was started from.
    pub fn spec(&self) -> &WorkerSpec {
        &self.spec
    }

    /// Where it stands; a replacement that finished its start in the background is the
    /// worker's process from then on (`Ready` with its pid).
    pub fn state(&self) -> WorkerState {
        let mut slot = self.live.lock();
        if slot.as_ref().is_none_or(|l| l.spoiled.load(Ordering::Acquire)) {
            let mut next = self.next.state.lock();
            if let Some(Ok(_)) = &next.started {
                if let Some(Ok(w)) = next.started.take() {
                    *slot = w.live.lock().take();
                }
            }
        }
        match &*slot {
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
        let mut call = self.start_call(object, method, args, kwargs, deadline)?;
        loop {
            if let Some(r) = self.wait_call(&mut call, Duration::MAX) {
                return r;
            }
        }
    }

    /// Send a call as [`call_with`](Self::call_with) does and return at once: wait for it
    /// with [`wait_call`](Self::wait_call) (in slices, for a caller that must stay
    /// responsive), or give it up with [`cancel_call`](Self::cancel_call). Waits for a
    /// start first when no process runs (see [`wait_ready`](Self::wait_ready)).
    pub fn start_call(&self, object: &str, method: &str, args: Vec<Value>, kwargs: Map, deadline: Option<Duration>) -> Result<WorkerCall> {
        let live = self.current()?;
        live.calls.fetch_add(1, Ordering::AcqRel);
        let after = deadline.or(self.spec.call_timeout);
        let mut call = WorkerCall {
            by: after.and_then(|d| Instant::now().checked_add(d)),
            after: after.unwrap_or(Duration::MAX),
            live: live.clone(),
            pending: None,
            object: object.to_owned(),
            method: method.to_owned(),
        };
        // The deadline is the worker's (it kills the process), not the connection's.
        let opts = CallOptions { timeout: Some(Wait::Forever), parent_call_id: None };
        match live.endpoint.start_call(object, method, args, kwargs, opts) {
            Ok(p) => {
                call.pending = Some(p);
                Ok(call)
            }
            Err(e) => Err(self.failed(&call, e)),
        }
    }

    /// Wait up to `slice` (and no later than the call's deadline) for a call started with
    /// [`start_call`](Self::start_call): `None` while it is still out. Past its deadline
    /// the process is killed and `Timeout` returned, as for `call_with`. Once it answered
    /// (`Some`), it is done: a later wait says so.
    pub fn wait_call(&self, call: &mut WorkerCall, slice: Duration) -> Option<Result<Value>> {
        let Some(pending) = call.pending.as_ref() else {
            return Some(Err(RpcError::InvalidArgument(format!("the call to {}.{} was already waited for or cancelled", call.object, call.method))));
        };
        let now = Instant::now();
        let slice = call.by.map_or(slice, |by| slice.min(by.saturating_duration_since(now)));
        let r = match pending.wait_slice(slice) {
            Some(r) => r,
            None if call.by.is_some_and(|by| Instant::now() >= by) => call.pending.take()?.expire(call.after),
            None => return None,
        };
        call.pending = None;
        Some(r.map_err(|e| self.failed(call, e)))
    }

    /// Give up a call started with [`start_call`](Self::start_call), as `on` says — also
    /// one a [`WorkerCall::canceller`] already cancelled at the connection.
    pub fn cancel_call(&self, mut call: WorkerCall, on: OnInterrupt) {
        if let Some(pending) = call.pending.take() {
            pending.cancel();
        }
        match on {
            OnInterrupt::Kill => {
                self.end_in_background(&call.live, &format!("killed: a call to {}.{} was interrupted", call.object, call.method));
                self.replace_in_background();
            }
            // Release: pairs with the Acquire load in `is_clean`.
            OnInterrupt::Abandon => call.live.abandoned.store(true, Ordering::Release),
        }
    }

    /// The error a call failed with, after retiring the process when the failure ended
    /// it: past its deadline it is killed; a connection that ended under the call (the
    /// worker died, or broke the protocol and was cut off) cannot serve again. Either way
    /// the replacement starts in the background.
    fn failed(&self, call: &WorkerCall, e: RpcError) -> RpcError {
        let (live, object, method) = (&call.live, &call.object, &call.method);
        match e {
            RpcError::Timeout { after, .. } => {
                let what = format!("{object}.{method} in worker {} (killed at its deadline)", live.pid);
                self.end(live, &format!("killed: a call to {object}.{method} passed its deadline of {after:?}"));
                self.replace_in_background();
                RpcError::Timeout { what, after }
            }
            e if live.endpoint.is_closed() => {
                let how = self.end(live, &format!("killed: its connection failed: {e}"));
                self.replace_in_background();
                match e {
                    RpcError::PeerGone(_) => RpcError::PeerGone(format!("worker {} {how}", live.pid)),
                    other => other,
                }
            }
            e => e,
        }
    }

    /// Start a replacement process in the background when none runs and none is starting
    /// (a start after a kill or a crash usually runs already), and wait up to `within` for
    /// it: whether a call made now would not wait for a start (a start that failed counts:
    /// the call reports its error). A caller that must stay responsive waits here in
    /// slices before it calls.
    pub fn wait_ready(&self, within: Duration) -> bool {
        if self.live.lock().as_ref().is_some_and(|l| !l.spoiled.load(Ordering::Acquire)) {
            return true;
        }
        self.start_next();
        let by = Instant::now() + within;
        let mut s = self.next.state.lock();
        while s.running {
            if self.next.done.wait_until(&mut s, by).timed_out() {
                return !s.running;
            }
        }
        true
    }

    /// After a kill or a crash: start the next process now, unless this is a pool's
    /// worker (the pool replaces it).
    fn replace_in_background(&self) {
        // Relaxed: set before the worker is shared (`no_background_replacement`).
        if self.replace.load(Ordering::Relaxed) {
            self.start_next();
        }
    }

    /// A pool's worker: the pool starts its replacements.
    pub(super) fn no_background_replacement(&self) {
        self.replace.store(false, Ordering::Relaxed);
    }

    /// Start a process in the background unless one is starting or started already.
    fn start_next(&self) {
        {
            let mut s = self.next.state.lock();
            if s.running || s.started.is_some() || s.closed {
                return;
            }
            s.running = true;
        }
        let (next, spec) = (self.next.clone(), self.spec.clone());
        let started = std::thread::Builder::new().name("tensorwire-worker-next".into()).spawn(move || {
            let w = spec.spawn();
            let mut s = next.state.lock();
            s.running = false;
            if s.closed {
                drop(s);
                drop(w); // its process ends with it
            } else {
                s.started = Some(w);
                drop(s);
            }
            next.done.notify_all();
        });
        if started.is_err() {
            self.next.state.lock().running = false;
        }
    }

    /// Whether the worker can serve again as it is: it runs, nothing is in flight, and it
    /// was never killed or broken (a pool reuses only such workers).
    pub fn is_clean(&self) -> bool {
        match &*self.live.lock() {
            Some(l) => {
                !l.spoiled.load(Ordering::Acquire)
                    && !l.abandoned.load(Ordering::Acquire)
                    && l.calls.load(Ordering::Acquire) == 0
                    && !process_ended(l)
            }
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
        // A replacement starting (or started) in the background: wait for it and take it.
        let started = {
            let mut s = self.next.state.lock();
            while s.running {
                self.next.done.wait(&mut s);
            }
            s.started.take()
        };
        if let Some(w) = started {
            let live = w?.live.lock().take().expect("a started worker has its process");
            *slot = Some(live.clone());
            return Ok(live);
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
        let l = Live { pid, keeper, child: Mutex::new(child), pidfd, endpoint, captured, calls: AtomicUsize::new(0), spoiled: AtomicBool::new(false), abandoned: AtomicBool::new(false) };
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
    /// `end`, with only the signal on this thread: an interrupted caller (Ctrl-C) gets its
    /// `KeyboardInterrupt` at once, and the wait for the process (a torch worker takes
    /// tens of milliseconds to die, a namespace to be torn down) happens on a thread of
    /// its own.
    fn end_in_background(&self, l: &Arc<Live>, why: &str) {
        if l.spoiled.swap(true, Ordering::AcqRel) {
            return;
        }
        *self.last_end.lock() = why.to_string();
        signal_end(l);
        let (l, why) = (l.clone(), why.to_string());
        let reaper = std::thread::Builder::new().name("tensorwire-worker-end".into()).spawn({
            let l = l.clone();
            let why = why.clone();
            move || drop(reap(&l, &why))
        });
        if reaper.is_err() {
            reap(&l, &why);
        }
    }

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
        // A replacement still starting is ended by its thread when it finishes.
        let started = {
            let mut s = self.next.state.lock();
            s.closed = true;
            s.started.take()
        };
        drop(started);
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

/// The first signal of `kill_and_reap`, without waiting: `SIGTERM` to a keeper, SIGKILL
/// to the group otherwise.
fn signal_end(l: &Live) {
    // SAFETY: `pid` is our child, not yet reaped (only `reap` reaps it), so it and its
    // group id still name it.
    unsafe {
        if l.keeper {
            libc::kill(l.pid as libc::pid_t, libc::SIGTERM);
        } else {
            libc::kill(-(l.pid as libc::pid_t), libc::SIGKILL);
        }
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
