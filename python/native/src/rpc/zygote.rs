//! The zygote from Python (`tensorwire.zygote`, `docs/DESIGN.md` "The zygote"): a spec
//! whose workers are forked from one, and the fork itself, made in the zygote.

use super::errors::to_py;
use super::worker::PySpec;
use pyo3::prelude::*;
use tensorwire_rpc::RpcError;

/// `spec` with its workers forked from a zygote started as `program zygote_args...`
/// (`tensorwire_rpc::worker::WorkerSpec::zygote`).
#[pyfunction]
pub fn spec_with_zygote(spec: &PySpec, zygote_args: Vec<String>) -> PySpec {
    spec.with_spec(spec.spec.clone().zygote(zygote_args))
}

/// The pid of `spec`'s zygote while one runs (it starts with the first worker).
#[pyfunction]
pub fn zygote_pid(spec: &PySpec) -> Option<u32> {
    spec.spec.zygote_pid()
}

/// A sandboxed worker's set-up as the supervisor's request carries it: `(ruleset fd,
/// connection fd, uid_map, gid_map, namespaces, own_proc)`.
type ForkedSandbox = (i32, i32, Vec<u8>, Vec<u8>, bool, bool);

/// Set-up of a forked worker before it runs Python again: what the exec path's
/// `pre_exec` does (own process group, SIGKILL when the supervisor's spawner thread ends,
/// limits), plus its output on fds 1 and 2.
///
/// # Safety
/// Runs in the child of a raw `clone`: async-signal-safe system calls only, no allocation.
unsafe fn child_setup(parent: libc::pid_t, output: Option<(i32, i32)>, limits: &[(libc::__rlimit_resource_t, Option<u64>); 3]) -> libc::c_int {
    // SAFETY: plain system calls on this process.
    unsafe {
        if libc::setpgid(0, 0) != 0 {
            return *libc::__errno_location();
        }
        if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) != 0 {
            return *libc::__errno_location();
        }
        // The supervisor died before the prctl: no signal will come.
        if libc::getppid() != parent {
            libc::_exit(127);
        }
        for (resource, limit) in limits {
            if let Some(v) = limit {
                let r = libc::rlimit { rlim_cur: *v as libc::rlim_t, rlim_max: *v as libc::rlim_t };
                if libc::setrlimit(*resource, &r) != 0 {
                    return *libc::__errno_location();
                }
            }
        }
        if let Some((out, err)) = output {
            if libc::dup2(out, 1) < 0 || libc::dup2(err, 2) < 0 {
                return *libc::__errno_location();
            }
        }
        0
    }
}

/// In a zygote: fork a worker as a child of the zygote's parent (`CLONE_PARENT`: the
/// supervisor reaps it, and it dies with the supervisor's spawner thread), make its
/// set-up (`child_setup`) and return 0 in the worker, its pid in the zygote. A set-up that
/// failed raises `OSError` in the zygote with the worker's pid in `.filename` — the
/// worker has exited and is the supervisor's to reap.
///
/// The zygote has one thread of its own running (this one; `import torch` starts one
/// more, idle), so the raw `clone` — which runs no `pthread_atfork` handlers — finds no
/// lock held by a thread that would not exist in the child.
///
/// With `sandbox` — `(ruleset fd, connection fd, uid_map, gid_map, namespaces, own_proc)`
/// from the supervisor's request — the child then makes the sandboxed worker's set-up
/// (`tensorwire_rpc::worker::confine_forked_worker`): with namespaces it becomes the
/// worker's keeper and the 0 returned is in the worker, pid 1 of its namespaces, and the
/// pid returned in the zygote is the keeper's; every fd but 0-2 and the connection is
/// closed in the worker.
#[pyfunction]
#[pyo3(signature = (parent, output=None, address_space=None, open_files=None, cpu_seconds=None, sandbox=None))]
pub fn zygote_fork(
    py: Python<'_>,
    parent: i32,
    output: Option<(i32, i32)>,
    address_space: Option<u64>,
    open_files: Option<u64>,
    cpu_seconds: Option<u64>,
    sandbox: Option<ForkedSandbox>,
) -> PyResult<i32> {
    let limits = [(libc::RLIMIT_AS, address_space), (libc::RLIMIT_NOFILE, open_files), (libc::RLIMIT_CPU, cpu_seconds)];
    let mut sync = [0; 2];
    // SAFETY: `sync` has room for two fds.
    if unsafe { libc::pipe2(sync.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    // SAFETY: called with the GIL held (we are in a Python call), paired with
    // PyOS_AfterFork_Parent / PyOS_AfterFork_Child below, as os.fork does.
    unsafe { pyo3::ffi::PyOS_BeforeFork() };
    // SAFETY: clone without a new stack is fork with CLONE_PARENT: the child continues on
    // a copy of this stack. No other flag shares anything with the child.
    let pid = unsafe { libc::syscall(libc::SYS_clone, (libc::CLONE_PARENT | libc::SIGCHLD) as libc::c_ulong, 0usize, 0usize, 0usize, 0usize) };
    if pid == 0 {
        // SAFETY: in the single-threaded child, before Python runs again: system calls
        // only (`confine_forked_worker` is async-signal-safe and allocates nothing; the
        // maps were made before the fork).
        unsafe {
            libc::close(sync[0]);
            let mut e = child_setup(parent, output, &limits);
            if e == 0 {
                if let Some((ruleset, conn, uid_map, gid_map, namespaces, own_proc)) = &sandbox {
                    // Returns in the worker (the keeper never does), its fds but 0-2 and
                    // the connection closed: `sync[1]` too, which ends the zygote's read.
                    if let Err(err) = tensorwire_rpc::worker::confine_forked_worker(*ruleset, uid_map, gid_map, *namespaces, *own_proc, *conn) {
                        e = err.raw_os_error().unwrap_or(libc::EPERM);
                    } else {
                        pyo3::ffi::PyOS_AfterFork_Child();
                        return Ok(0);
                    }
                }
            }
            if e != 0 {
                libc::write(sync[1], (&e as *const libc::c_int).cast(), std::mem::size_of::<libc::c_int>());
                libc::_exit(127);
            }
            libc::close(sync[1]);
            pyo3::ffi::PyOS_AfterFork_Child();
        }
        return Ok(0);
    }
    // SAFETY: the parent side of PyOS_BeforeFork.
    unsafe { pyo3::ffi::PyOS_AfterFork_Parent() };
    // SAFETY: our own write end.
    unsafe { libc::close(sync[1]) };
    if pid < 0 {
        let e = std::io::Error::last_os_error();
        // SAFETY: our own read end.
        unsafe { libc::close(sync[0]) };
        return Err(to_py(py, &RpcError::Io(format!("zygote: clone(CLONE_PARENT) for a worker: {e}"))));
    }
    // The child's set-up ends with its end of the pipe closed (EOF) or an errno on it.
    let mut e: libc::c_int = 0;
    let n = py.detach(|| loop {
        // SAFETY: reads into `e`, at most its size.
        let n = unsafe { libc::read(sync[0], (&mut e as *mut libc::c_int).cast(), std::mem::size_of::<libc::c_int>()) };
        if n >= 0 || std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            break n;
        }
    });
    // SAFETY: our own read end.
    unsafe { libc::close(sync[0]) };
    if n > 0 {
        let err = std::io::Error::from_raw_os_error(e);
        return Err(pyo3::exceptions::PyOSError::new_err((e, format!("a forked worker's set-up failed: {err}"), pid.to_string())));
    }
    Ok(pid as i32)
}
