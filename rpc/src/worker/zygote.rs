//! Workers forked from a zygote (`docs/DESIGN.md`, "The zygote", "Starting fast"): a
//! process of the spec's program, started once per spec through the ordinary launch (its
//! end of a socketpair inherited as its control socket; never sandboxed: it runs trusted
//! code only — for a sandboxed spec with the allow-listed environment only), that has
//! done a worker's imports and forks a worker per request. A sandboxed spec's request
//! carries the sandbox prepared as for an exec'd worker (the landlock ruleset by fd), and
//! the zygote's child makes the keeper's and the worker's set-up
//! (`worker::confine_forked_worker`) before the worker's Python runs.
//!
//! A request (one `sendmsg`) carries a JSON header and, by `SCM_RIGHTS`, the new worker's
//! end of its connection and, when the spec takes its output, the write ends of its
//! stdout and stderr pipes. The zygote forks with `CLONE_PARENT`, so the worker is **this
//! process's child** (reaped with `waitpid`, its death signal tied to the spawner thread
//! like an exec'd worker's, and the zygote's death takes no worker with it); the worker
//! makes the exec path's set-up (its own process group, death with the supervisor,
//! limits) before the zygote answers with its pid.
//!
//! Wire (both ways a little-endian `u32` length, then that many bytes of JSON):
//! request `{"argv": [...], "parent": pid, "limits": [as|null, nofile|null, cpu|null],
//! "output": bool, "sandbox": null | {"uid_map", "gid_map", "namespaces", "own_proc",
//! "policy": the worker's SANDBOX_ENV}}` with fds `[connection, (stdout, stderr),
//! (landlock ruleset)]`; answer `{"pid": n}` (the keeper's pid for a sandboxed one) or
//! `{"error": "...", "pid": n|null}` (a pid there is a child that failed its set-up and
//! exited: ours to reap).

use super::contain;
use super::launch::{launch, Launched};
use super::output;
use super::process::Process;
use super::{Limits, Output, WorkerSpec};
use crate::{Result, RpcError};
use parking_lot::Mutex;
use serde_json::json;
use std::ffi::OsString;
use std::io::Read;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};
use tensorwire::os::{pidfd_process_end, ProcessEnd};

/// The largest answer a zygote may send.
const MAX_ANSWER: usize = 64 << 10;

/// One spec's zygote: started on the first request, restarted when it died, killed when
/// the last clone of its spec is dropped.
pub(crate) struct Zygote {
    args: Vec<OsString>,
    running: Mutex<Option<Running>>,
}

struct Running {
    process: Process,
    pid: u32,
    pidfd: Option<OwnedFd>,
    control: UnixStream,
}

impl Zygote {
    pub(crate) fn new(args: Vec<OsString>) -> Zygote {
        Zygote { args, running: Mutex::new(None) }
    }

    /// The zygote's pid while one runs.
    pub(crate) fn pid(&self) -> Option<u32> {
        self.running.lock().as_ref().map(|r| r.pid)
    }

    /// Fork a worker of `spec` from the zygote (starting the zygote first if none runs or
    /// it died). An error leaves no zygote behind that failed a request: the next start
    /// starts a fresh one.
    pub(crate) fn launch(&self, spec: &WorkerSpec) -> Result<Launched> {
        let mut slot = self.running.lock();
        if slot.as_ref().is_some_and(ended) {
            if let Some(mut dead) = slot.take() {
                let _ = dead.process.wait();
            }
        }
        if slot.is_none() {
            *slot = Some(self.start(spec)?);
        }
        let running = slot.as_mut().expect("set above");
        let by = Instant::now() + spec.handshake_timeout;
        match request(running, spec, by) {
            Ok(l) => Ok(l),
            Err(e) => {
                if let Some(mut r) = slot.take() {
                    kill(&mut r);
                }
                Err(e)
            }
        }
    }

    fn start(&self, spec: &WorkerSpec) -> Result<Running> {
        // The zygote is trusted code: no sandbox, no limits (a worker's are set per
        // worker), its output the supervisor's.
        let mut z = WorkerSpec::new(&spec.program).args(self.args.iter().cloned()).output(Output::Inherit);
        z.env = spec.env.clone();
        z.cwd = spec.cwd.clone();
        // A sandboxed spec's workers inherit the zygote's memory, its environment block
        // included: the zygote starts with only what they may see.
        z.clean_env = spec.sandbox.is_some();
        let Launched { child, pid, pidfd, conn, .. } = launch(&z)?;
        Ok(Running { process: child, pid, pidfd, control: UnixStream::from(conn) })
    }
}

impl Drop for Zygote {
    fn drop(&mut self) {
        if let Some(mut r) = self.running.get_mut().take() {
            kill(&mut r);
        }
    }
}

fn ended(r: &Running) -> bool {
    r.pidfd.as_ref().is_some_and(|p| pidfd_process_end(p.as_fd()) != ProcessEnd::Running)
}

fn kill(r: &mut Running) {
    // SAFETY: the zygote leads its own process group (the launch's setpgid) and is not
    // reaped yet, so the group id still names it; its workers are in groups of their own.
    unsafe { libc::kill(-(r.pid as libc::pid_t), libc::SIGKILL) };
    let _ = r.process.wait();
}

fn bad(pid: u32, what: &str) -> RpcError {
    RpcError::Io(format!("zygote {pid}: {what}"))
}

/// Ask the zygote for one worker and take it as a launched process of ours.
fn request(z: &mut Running, spec: &WorkerSpec, by: Instant) -> Result<Launched> {
    let (ours, theirs) = UnixStream::pair().map_err(|e| RpcError::io("socketpair for a worker", e))?;
    let (theirs, ours): (OwnedFd, OwnedFd) = (theirs.into(), ours.into());
    let pipes = output::pipes(&spec.output).map_err(|e| RpcError::io("pipes for a worker's output", e))?;
    let Limits { address_space, open_files, cpu_seconds } = spec.limits;
    let argv: Vec<String> = spec.args.iter().map(|a| a.to_string_lossy().into_owned()).collect();
    // A sandboxed worker: the same preparation as an exec'd one; the ruleset goes with
    // the request, and the zygote's child makes the keeper's and the worker's set-up.
    let prepared = spec.sandbox.as_ref().map(|s| contain::prepare(s, &spec.program).map(|p| (p, s.to_json()))).transpose()?;
    let sandbox = prepared.as_ref().map(|(p, json)| {
        let (_, uid_map, gid_map, namespaces, own_proc) = p.for_zygote();
        json!({
            "uid_map": String::from_utf8_lossy(uid_map),
            "gid_map": String::from_utf8_lossy(gid_map),
            "namespaces": namespaces,
            "own_proc": own_proc,
            "policy": json,
        })
    });
    let header = json!({
        "argv": argv,
        "parent": std::process::id(),
        "limits": [address_space, open_files, cpu_seconds],
        "output": pipes.is_some(),
        "sandbox": sandbox,
    })
    .to_string();
    let mut msg = (header.len() as u32).to_le_bytes().to_vec();
    msg.extend_from_slice(header.as_bytes());
    let mut fds = vec![theirs.as_fd()];
    if let Some((_, w)) = &pipes {
        fds.extend(w.iter().map(|f| f.as_fd()));
    }
    if let Some((p, _)) = &prepared {
        fds.push(p.for_zygote().0);
    }
    tensorwire::os::send_msg(z.control.as_fd(), &msg, &fds, false, tensorwire::Wait::Forever)
        .map_err(|e| bad(z.pid, &format!("sending a request: {e}")))?;
    drop(fds);
    drop(theirs);
    let (read, _) = pipes.map_or((None, None), |(r, w)| (Some(r), Some(w)));
    let answer = read_answer(z, by)?;
    let pid = answer.get("pid").and_then(serde_json::Value::as_u64).map(|p| p as u32);
    if let Some(why) = answer.get("error") {
        if let Some(p) = pid {
            // A child that failed its set-up exited: reap it.
            let _ = Process::Forked { pid: p, ended: None }.wait();
        }
        return Err(RpcError::Io(format!("zygote {} could not start a worker: {}", z.pid, why.as_str().unwrap_or("(no reason given)"))));
    }
    let pid = pid.filter(|p| *p > 0).ok_or_else(|| bad(z.pid, &format!("answered {answer} without a pid")))?;
    let pidfd = tensorwire::os::pidfd_open(pid as libc::pid_t);
    let captured = output::attach_fds(read, &spec.output, pid);
    let keeper = prepared.as_ref().is_some_and(|(p, _)| p.for_zygote().3);
    Ok(Launched { child: Process::Forked { pid, ended: None }, pid, pidfd, conn: ours, captured, keeper })
}

/// One answer, by `by` (the zygote's imports count against it on its first request).
fn read_answer(z: &mut Running, by: Instant) -> Result<serde_json::Value> {
    let pid = z.pid;
    let mut read_exact = |buf: &mut [u8]| -> Result<()> {
        let mut got = 0;
        while got < buf.len() {
            let left = by.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(RpcError::Timeout { what: format!("the answer of zygote {pid}"), after: Duration::ZERO });
            }
            z.control.set_read_timeout(Some(left)).map_err(|e| RpcError::io("a zygote's control socket", e))?;
            match z.control.read(&mut buf[got..]) {
                Ok(0) => return Err(bad(pid, "closed its control socket (it died: see its stderr)")),
                Ok(n) => got += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
                Err(e) => return Err(bad(pid, &format!("reading its answer: {e}"))),
            }
        }
        Ok(())
    };
    let mut len = [0u8; 4];
    read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_ANSWER {
        return Err(bad(pid, &format!("sent an answer of {len} bytes (at most {MAX_ANSWER})")));
    }
    let mut body = vec![0u8; len];
    read_exact(&mut body)?;
    serde_json::from_slice(&body).map_err(|e| bad(pid, &format!("sent an answer that is not JSON: {e}")))
}
