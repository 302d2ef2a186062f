"""Run Python code in worker processes and call it, at Rust speed: ``tensorwire.rpc`` is
the ``tensorwire-rpc`` crate (pyisolate's JSON wire, never pickle) with its supervisor,
reached through the package's PyO3 binding ``tensorwire._native``.

    import tensorwire

    with tensorwire.spawn("mypkg.plugin:Plugin", timeout=30.0) as w:
        w.call("add", 1, 2)                       # 3, run in the worker
        y = w.call("scale", x, 2.0)               # tensors travel as shared memory

A worker is ``python -m tensorwire.worker module:attr`` started by this process with an
inherited socketpair (no path anyone could guess), that serves the object ``attr`` names
(a class is instantiated once). Its supervisor here:

- kills it when a call passes its deadline (the call raises :class:`tensorwire.Timeout`;
  leases it held on our tensors are reclaimed) and starts a fresh one at once, in the
  background, for the next call;
- fails the calls in flight with :class:`tensorwire.PeerGone` saying how it ended when it
  crashes (a signal, ``os._exit``), and starts a fresh one in the background;
- raises :class:`KeyboardInterrupt` within ~50 ms when Ctrl-C comes during a call, and
  kills the worker (``on_interrupt="kill"``, replaced in the background) or drops the call
  (``"abandon"``); cancelling an ``acall`` task does the same;
- has it die with this process (``PR_SET_PDEATHSIG`` on its process group's leader);
- applies resource :class:`Limits` and, optionally, contains it in a :class:`Sandbox`
  (its own namespaces, a file-system allow-list, an allow-listed environment, a
  system-call policy) before it runs the target's code.

Values are JSON data (None, bool, int, float, str, list, tuple, dict with str keys) and CPU
and CUDA tensors. CPU tensors, by where their storage is:

- a segment of this module (:func:`empty`, or a storage moved into one, below): sent
  without a copy, any view of it as it is, under a lease that ends when the receiver's last
  view dies;
- a tensor received from a peer (or any view of its storage): sent on as that peer's own
  memory, no copy — a worker returning the tensor it was given hands the caller back its
  own memory;
- anything else (``torch.randn``, a model's output), a view of up to 1 MiB: its elements,
  packed, are copied into a recycled segment of this process's pool (size classes from 4
  KiB, at most 16 a class and 32 MiB in all; a segment is used again once the receiver let
  go of it, so a call in a loop makes no new shared memory); the tensor itself is untouched;
- anything else, a view larger than 1 MiB: its whole storage is **moved into a segment in
  place** on its first trip, as ``Tensor.share_memory_()`` does: every tensor viewing that
  storage now reads the segment, and later sends of any of them are zero-copy. As with
  ``share_memory_()``, memory that aliased the old storage (a NumPy array from
  ``from_numpy``/``.numpy()``, a raw pointer) no longer does, and the storage can no longer
  be resized. A storage already in shared memory (``share_memory_()``, a
  ``torch.multiprocessing`` peer's) is not moved, and neither is one on a torch without
  ``UntypedStorage._swap_data_ptr_``: such a view is copied once into a fresh segment.

A CUDA tensor travels by CUDA
IPC without a copy, ordered after the work queued on the sender's current stream; it
arrives on the receiver's current stream of that device (which waits for the sender as the
connection's ``cuda_wait`` says), and its lease ends once torch's last view of it dies and
the work queued on that stream has run. A CUDA tensor received from a peer and sent on is
cloned first. An exception in the worker raises
:class:`tensorwire.RemoteError` here, with the remote type name and traceback text.

A worker calls back into its host through :func:`host` (the objects the host passed as
``serve=``).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import json
import os
import sys
import sysconfig
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from .errors import RemoteError

try:
    from . import _native
except ImportError as e:  # pragma: no cover - a broken install
    raise ImportError(
        "tensorwire.rpc needs the package's binding tensorwire._native, which this install "
        f"lacks ({e}); reinstall tensorwire (pip install --no-build-isolation .)"
    ) from e

__all__ = [
    "Endpoint", "PendingCall", "Worker", "WorkerPool", "PooledWorker", "Limits", "Sandbox",
    "Listener", "spawn", "pair", "connect", "host", "empty", "RemoteError", "MAIN", "KEPT_ENV",
]

#: The object id a worker serves its target as.
MAIN = "main"

# The binding's classes behind this module's (their types: _native.pyi), under names that
# class bodies declaring their own `_native` attribute can still refer to.
_NativeWorker = _native.Worker
_NativePooledWorker = _native.PooledWorker


def empty(*size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A zero-filled tensor in a fresh shared segment: sending it through
    ``tensorwire.rpc`` copies nothing (the receiver maps the same memory)."""
    shape = list(size[0]) if len(size) == 1 and isinstance(size[0], (list, tuple, torch.Size)) else list(size)
    numel = 1
    for n in shape:
        numel *= int(n)
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.from_dlpack(_native.segment_storage(numel * itemsize))
    return raw.view(dtype).view(shape)


_async_pool: Optional[concurrent.futures.ThreadPoolExecutor] = None


def _executor() -> concurrent.futures.ThreadPoolExecutor:
    # Blocking calls release the GIL while they wait, so threads are what awaiting one
    # costs; its own pool keeps them from queueing behind the loop's default executor.
    global _async_pool
    if _async_pool is None:
        _async_pool = concurrent.futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="tensorwire-rpc")
    return _async_pool


async def _awaited(native_call: _native.PendingCall | _native.WorkerCall, wait: Callable[[Any], Any]) -> Any:
    # The call is out already; a thread waits for it (its waits release the GIL), and a
    # cancelled task cancels it, which wakes that thread at once.
    loop = asyncio.get_running_loop()
    try:
        return await loop.run_in_executor(_executor(), wait, native_call)
    except asyncio.CancelledError:
        native_call.cancel()
        raise


def _wait_pending(timeout: Optional[float], native_call: _native.PendingCall) -> Any:
    return native_call.wait(timeout)


def _wait_worker_call(native_call: _native.WorkerCall) -> Any:
    return native_call.wait()


class PendingCall:
    """A call sent and not yet waited for (:meth:`Endpoint.start`)."""

    def __init__(self, native: _native.PendingCall) -> None:
        self._native = native

    def result(self, timeout: Optional[float] = None) -> Any:
        """The call's result, waiting up to ``timeout`` seconds more; raises its error.
        Ctrl-C raises :class:`KeyboardInterrupt` within ~50 ms and abandons the call."""
        return self._native.wait(timeout)

    def done(self) -> bool:
        return self._native.done()

    def cancel(self) -> None:
        self._native.cancel()


class Endpoint:
    """One RPC connection: call the objects the peer serves, serve objects to it."""

    def __init__(self, native: _native.Endpoint) -> None:
        self._native = native

    def call(self, object_id: str, method: str, *args: Any, timeout: Optional[float] = None, **kwargs: Any) -> Any:
        """``object_id.method(*args, **kwargs)`` on the peer, waiting up to ``timeout``
        seconds (None: no limit). Ctrl-C raises :class:`KeyboardInterrupt` within ~50 ms
        and abandons the call (its answer is dropped when it comes)."""
        return self._native.call(object_id, method, args, kwargs, timeout)

    async def acall(self, object_id: str, method: str, *args: Any, timeout: Optional[float] = None, **kwargs: Any) -> Any:
        """:meth:`call` for asyncio: the loop keeps running while the call is out.
        Cancelling the task abandons the call (its answer is dropped when it comes)."""
        return await _awaited(self._native.start(object_id, method, args, kwargs, timeout), functools.partial(_wait_pending, timeout))

    def start(self, object_id: str, method: str, *args: Any, timeout: Optional[float] = None, **kwargs: Any) -> PendingCall:
        """Send the call now; wait for it later with :meth:`PendingCall.result`."""
        return PendingCall(self._native.start(object_id, method, args, kwargs, timeout))

    def register(self, object_id: str, obj: Any) -> None:
        """Serve ``obj``'s public methods to the peer as ``object_id``."""
        self._native.register(object_id, obj)

    @property
    def closed(self) -> bool:
        return self._native.closed

    @property
    def remote(self) -> bool:
        """Whether CPU tensors travel to and from the peer as remote tensors (a UCX get by
        the receiver) on this connection; see :func:`connect`."""
        return self._native.remote

    @property
    def native(self) -> bool:
        """Whether tensors travel as shared memory (else as pyisolate ``file_system``
        references or inline bytes)."""
        return self._native.native

    def close(self, timeout: float = 1.0) -> None:
        self._native.close(timeout)

    def __enter__(self) -> "Endpoint":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def pair(serve_a: Optional[Mapping[str, Any]] = None, serve_b: Optional[Mapping[str, Any]] = None, native: bool = True,
         *, fs_tensors: bool = False) -> tuple[Endpoint, Endpoint]:
    """Two connected endpoints in this process (tests, examples). ``fs_tensors`` as for
    :func:`connect`, for both."""
    a, b = _native.Endpoint.pair(dict(serve_a or {}), dict(serve_b or {}), native, fs_tensors)
    return Endpoint(a), Endpoint(b)


def connect(address: str, serve: Optional[Mapping[str, Any]] = None, *, remote_tensors: bool = False,
            timeout: float = 10.0, fs_tensors: bool = False) -> Endpoint:
    """A connection to a :class:`Listener` (or any tensorwire-rpc server) at ``address``:
    ``"tcp://host:port"`` or a Unix socket path. Over TCP a CPU tensor is copied into the
    message (JSON) unless ``remote_tensors``: then, where the peer's listener has it too,
    the receiver reads it with one UCX get (:attr:`Endpoint.remote` says whether that was
    agreed). **Trusted peers only**: over tcp and shared memory UCX lets the peer read any
    memory of this process, not just the tensors sent (DESIGN.md, "Remote peers"). Needs a
    binding built with the ``ucx`` feature (``build_info()["ucx_built"]``); the wheel has
    none, and asking for it there raises :class:`tensorwire.Refused`.

    ``fs_tensors``: read the ``/dev/shm`` files a pyisolate peer's ``TensorRef`` values
    name (how pyisolate sends CPU tensors). Off (the default), such a value is refused
    (:class:`tensorwire.Refused`): a peer must not make this process open a file of its
    choosing. Turn it on for a trusted pyisolate peer only; a file this process did not
    create is then only read, never written or removed."""
    return Endpoint(_native.Endpoint.connect(address, dict(serve or {}), remote_tensors, timeout, fs_tensors))


class Listener:
    """Accepts :func:`connect` connections on ``address`` (``"tcp://127.0.0.1:0"`` picks a
    port; :attr:`address` is the real one), each serving ``serve``. ``remote_tensors`` as
    for :func:`connect` — both sides must ask for it; ``fs_tensors`` as for :func:`connect`,
    for every connection accepted."""

    def __init__(self, address: str, serve: Optional[Mapping[str, Any]] = None, *,
                 remote_tensors: bool = False, fs_tensors: bool = False) -> None:
        self._native = _native.RpcListener(address, dict(serve or {}), remote_tensors, fs_tensors)

    @property
    def address(self) -> str:
        return self._native.address

    def accept(self) -> Endpoint:
        """Waits for the next connection."""
        return Endpoint(self._native.accept())


def host() -> Endpoint:
    """In a worker: the connection to the host that started it, to call the objects the
    host passed as ``serve=`` (``host().call("name", "method", ...)``)."""
    ep = _native.host()
    if ep is None:
        raise RuntimeError("tensorwire.rpc.host(): this process is not a serving tensorwire worker")
    return Endpoint(ep)


@dataclasses.dataclass(frozen=True)
class Limits:
    """Resource limits set in the worker before it runs (``setrlimit``)."""

    address_space: Optional[int] = None  #: bytes (RLIMIT_AS)
    open_files: Optional[int] = None  #: descriptors (RLIMIT_NOFILE)
    cpu_seconds: Optional[int] = None  #: CPU time, then SIGKILL (RLIMIT_CPU)


@dataclasses.dataclass(frozen=True)
class Sandbox:
    """Run the worker contained (``docs/DESIGN.md``, "Containment levels"): its own user,
    pid, network, IPC, UTS and cgroup namespaces (it is pid 1 there: it can name no
    process of yours, and everything it starts ends with it); read (and execute) only
    under ``read``, the interpreter and the import path, also write under ``write``; no
    sockets unless ``network``; no ``exec`` unless ``exec``; an allow-listed environment
    (``tensorwire.rpc.KEPT_ENV``, plus ``spawn(env=...)``); only its connection and fds
    0-2; no capabilities; a seccomp policy denying the kernel surface a worker never
    needs. The file-system and namespace levels are in place before the interpreter
    starts, the system-call policy before the target's module is imported. A level this
    machine cannot give makes :func:`spawn` raise :class:`tensorwire.Refused` naming it
    (``python -m tensorwire doctor`` says what the machine gives); ``namespaces=False``
    asks for less, for machines that refuse user namespaces.

    ``gpu=True`` makes the NVIDIA devices usable (their files and ioctls, what the driver
    reads as it starts). CUDA tensors cross the sandbox's pid namespace by file
    descriptor: memory of PyTorch's expandable segments
    (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``) is shared as it is, other CUDA
    memory travels as a device-to-device copy (the worker's writes to it do not reach the
    sender's tensor)."""

    read: Sequence[str] = ()
    write: Sequence[str] = ()
    network: bool = False
    exec: bool = False
    namespaces: bool = True
    gpu: bool = False


#: The variables of this process a sandboxed worker gets (when set), by name and by
#: prefix (``LC_``, ``NVIDIA_``, ``TENSORWIRE_``): ``(names, prefixes)``, the supervisor's
#: own list. Pass anything else with ``spawn(env=...)``.
KEPT_ENV: tuple[list[str], list[str]] = _native.kept_env()


def _readable_python() -> list[str]:
    """The interpreter and its installed packages: never ``sys.path[0]`` (the host
    script's directory) or the current directory, which hold the host's own files."""
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix}
    paths.update(v for k, v in sysconfig.get_paths().items() if k in ("stdlib", "platstdlib", "purelib", "platlib"))
    paths.add(os.path.dirname(os.path.realpath(sys.executable)))
    return sorted(p for p in paths if p and os.path.isdir(p))


def _spec(target: Optional[str], *, command: Optional[Sequence[str]], python: Optional[str], env: Optional[Mapping[str, str]],
          cwd: Optional[str], output: str, prefix: Optional[str], capture_bytes: int, limits: Optional[Limits],
          sandbox: Optional[Sandbox], handshake_timeout: float, timeout: Optional[float], serve: Optional[Mapping[str, Any]],
          path: Optional[Sequence[str]] = None, zygote: bool = False, preload: Sequence[str] = ()) -> _native.WorkerSpec:
    if (target is None) == (command is None):
        raise ValueError("tensorwire.rpc: give a target ('module:attribute') or a command (a worker program), not both")
    if command is not None:
        argv = [os.fspath(a) for a in command]
        if not argv:
            raise ValueError("tensorwire.rpc: command is empty")
    elif ":" not in target:  # type: ignore[operator]
        raise ValueError(f"tensorwire.rpc: target {target!r} must be 'module:attribute' (e.g. 'mypkg.plugin:Plugin')")
    else:
        # -P (3.11+): the current directory is not put on the worker's import path.
        safe_path = ["-P"] if python is None and sys.version_info >= (3, 11) else []
        argv = [python or sys.executable, *safe_path, "-m", "tensorwire.worker", target]  # type: ignore[list-item]
    if prefix is not None:
        output = "prefix"
    environ = dict(env or {})
    # The child imports this same package: make it findable as this process finds it.
    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    given = environ.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    imports = [os.path.abspath(os.fspath(p)) for p in (path or ())]
    search = [pkg_root] + imports + [p for p in given.split(os.pathsep) if p]
    environ["PYTHONPATH"] = os.pathsep.join(search)
    box = None
    if sandbox is not None:
        readable = set(map(os.fspath, sandbox.read)) | set(_readable_python()) | {p for p in search if os.path.isabs(p)}
        box = (sorted(readable), [os.fspath(w) for w in sandbox.write], not sandbox.network, not sandbox.exec, sandbox.namespaces,
               sandbox.gpu)
    lim = limits or Limits()
    native_spec = _native.WorkerSpec(
        argv[0], argv[1:],
        env=sorted(environ.items()), cwd=cwd, output=output, prefix=prefix or "", capture_bytes=capture_bytes,
        address_space=lim.address_space, open_files=lim.open_files, cpu_seconds=lim.cpu_seconds, sandbox=box,
        handshake_timeout=handshake_timeout, call_timeout=timeout, serve=dict(serve or {}), native=True,
    )
    return _with_zygote(native_spec, target, command=command, sandbox=sandbox, zygote=zygote, preload=preload)


def _with_zygote(native_spec: _native.WorkerSpec, target: Optional[str], *, command: Optional[Sequence[str]],
                 sandbox: Optional[Sandbox], zygote: bool, preload: Sequence[str]) -> _native.WorkerSpec:
    """``native_spec`` with its workers forked from a zygote (``python -P -m
    tensorwire.zygote``) that imported torch, tensorwire, ``preload`` and — only for an
    unsandboxed worker — the target's module. A sandboxed worker is contained as it is
    forked and imports its target itself, inside its containment."""
    if not zygote:
        if preload:
            raise ValueError("tensorwire.rpc: preload= names modules for the zygote; give zygote=True too")
        return native_spec
    if command is not None:
        raise ValueError("tensorwire.rpc: zygote=True forks Python target workers; a command is exec'd (leave zygote out)")
    modules = [str(m) for m in preload]
    if sandbox is None:
        modules.append(target.partition(":")[0])  # type: ignore[union-attr]
    safe_path = ["-P"] if sys.version_info >= (3, 11) else []
    return _native.spec_with_zygote(native_spec, [*safe_path, "-m", "tensorwire.zygote", *modules])


class _Calls:
    """Calls on a worker's :data:`MAIN` object (or another it serves)."""

    _native: _NativeWorker | _NativePooledWorker

    def call(self, method: str, *args: Any, timeout: Optional[float] = None, object_id: str = MAIN, **kwargs: Any) -> Any:
        """``target.method(*args, **kwargs)`` in the worker. Past ``timeout`` seconds
        (None: the worker's default from ``spawn(timeout=...)``) the worker is killed and
        :class:`tensorwire.Timeout` raised; its replacement starts at once, in the
        background, and the next call goes to it. Ctrl-C raises :class:`KeyboardInterrupt`
        within ~50 ms and cancels the call as ``spawn(on_interrupt=...)`` says."""
        return self._native.call(object_id, method, args, kwargs, timeout)

    def __call__(self, *args: Any, timeout: Optional[float] = None, **kwargs: Any) -> Any:
        """Call the target itself: a function target (``spawn("mod:func")``), or an
        instance whose class defines ``__call__`` — ``w(x)`` is ``w.call("__call__", x)``."""
        return self._native.call(MAIN, "__call__", args, kwargs, timeout)

    async def acall(self, method: str, *args: Any, timeout: Optional[float] = None, object_id: str = MAIN, **kwargs: Any) -> Any:
        """:meth:`call` for asyncio. Cancelling the task cancels the call as an
        interrupt does (``spawn(on_interrupt=...)``)."""
        return await _awaited(self._native.start(object_id, method, args, kwargs, timeout), _wait_worker_call)

    @property
    def pid(self) -> Optional[int]:
        """The running process's pid (None while no process runs)."""
        return self._native.state()[1]

    @property
    def state(self) -> str:
        """``"ready"``, or ``"down: <why>"`` (the next call starts a fresh process)."""
        state, _, why = self._native.state()
        return state if state == "ready" else f"down: {why}"

    def is_clean(self) -> bool:
        return self._native.is_clean()

    def output(self) -> tuple[bytes, bytes]:
        """``(stdout, stderr)`` captured so far (``spawn(output="capture")``)."""
        out = self._native.output()
        if out is None:
            raise RuntimeError("tensorwire.rpc: this worker's output is not captured; spawn it with output='capture'")
        return out

    def kill(self) -> None:
        """Kill the process (and its process group) now."""
        self._native.kill()


class Worker(_Calls):
    """A supervised worker process (see :func:`spawn`). Close it (or use ``with``) to end
    it: a clean close, then SIGKILL after a grace period."""

    _native: _NativeWorker

    def __init__(self, native: _NativeWorker) -> None:
        self._native = native

    def close(self) -> None:
        self._native.close()

    def __enter__(self) -> "Worker":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


#: The environment variable carrying a class target's constructor arguments (JSON).
INIT_ENV = "TENSORWIRE_WORKER_INIT"


def _with_init(env: Optional[Mapping[str, str]], target: Optional[str], init_args: Optional[Sequence[Any]],
               init_kwargs: Optional[Mapping[str, Any]]) -> Optional[Mapping[str, str]]:
    """``env`` plus the constructor arguments for the worker (``tensorwire.worker``)."""
    if init_args is None and init_kwargs is None:
        return env
    if target is None:
        raise ValueError("tensorwire.rpc: init_args / init_kwargs are for a class target ('module:Class'), not a command")
    try:
        text = json.dumps({"args": list(init_args or ()), "kwargs": dict(init_kwargs or {})}, allow_nan=True)
    except (TypeError, ValueError) as e:
        raise ValueError(f"tensorwire.rpc: init_args and init_kwargs must be JSON values (they reach the worker as JSON): {e}") from None
    return {**(env or {}), INIT_ENV: text}


def _on_interrupt(spec: _native.WorkerSpec, on_interrupt: str) -> _native.WorkerSpec:
    if on_interrupt not in ("kill", "abandon"):
        raise ValueError(f"tensorwire.rpc: on_interrupt={on_interrupt!r}: use 'kill' or 'abandon'")
    return spec.with_on_interrupt(on_interrupt)


def spawn(target: Optional[str] = None, *, command: Optional[Sequence[str]] = None, python: Optional[str] = None,
          env: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None,
          output: str = "inherit", prefix: Optional[str] = None, capture_bytes: int = 1 << 16, limits: Optional[Limits] = None,
          sandbox: Optional[Sandbox] = None, handshake_timeout: float = 60.0, timeout: Optional[float] = None,
          serve: Optional[Mapping[str, Any]] = None, init_args: Optional[Sequence[Any]] = None,
          init_kwargs: Optional[Mapping[str, Any]] = None, on_interrupt: str = "kill",
          path: Optional[Sequence[str]] = None, zygote: bool = False, preload: Sequence[str] = ()) -> Worker:
    """Start a worker serving ``target`` (``"module:attr"``) and wait for its handshake
    (``handshake_timeout`` seconds, which include its imports). A class is instantiated,
    with ``init_args`` and ``init_kwargs`` (JSON values) when given; its public methods
    are what :meth:`Worker.call` calls. A function (or any callable instance) is called
    as ``w(...)`` (``w.call("__call__", ...)``). Or run ``command`` (a program and its
    arguments) as the worker: any program that serves the protocol, e.g. a Rust one
    calling ``tensorwire_rpc::worker::serve``.

    ``output``: ``"inherit"``, ``"capture"`` (see :meth:`Worker.output`), or give a
    ``prefix`` to forward each line after it. ``timeout``: the default per-call deadline in
    seconds. ``serve``: objects of this process the worker may call back (:func:`host`).
    ``on_interrupt``: what Ctrl-C during a call (or cancelling an ``acall``) does to the
    worker — ``"kill"`` (it is killed, the only way to stop a Python handler in the
    middle, and a replacement starts in the background) or ``"abandon"`` (the call's
    answer is dropped when it comes; the worker keeps running it). ``path``: directories
    put first on the worker's import path (and, sandboxed, made readable), e.g.
    ``[pathlib.Path(__file__).parent]`` for a target beside the host's script: the
    worker's import path never holds the current directory or the host script's
    directory by itself.

    ``zygote``: fork the worker (and its replacements after a kill or a crash) from a
    zygote of this worker's own, a process that imported torch, tensorwire, the modules
    in ``preload`` and the target's module once: a replacement starts in milliseconds
    instead of paying the imports again (``docs/DESIGN.md``, "The zygote"). A sandboxed
    worker is exec'd (its target is never imported outside its containment)."""
    env = _with_init(env, target, init_args, init_kwargs)
    spec = _spec(target, command=command, python=python, env=env, cwd=cwd, output=output, prefix=prefix, capture_bytes=capture_bytes,
                 limits=limits, sandbox=sandbox, handshake_timeout=handshake_timeout, timeout=timeout, serve=serve, path=path,
                 zygote=zygote, preload=preload)
    return Worker(_native.Worker.spawn(_on_interrupt(spec, on_interrupt)))


class PooledWorker(_Calls):
    """A worker handed out by a :class:`WorkerPool`; :meth:`release` (or leaving ``with``)
    gives it back, kept warm only if it finished cleanly."""

    _native: _NativePooledWorker

    def __init__(self, native: _NativePooledWorker) -> None:
        self._native = native

    def release(self) -> None:
        self._native.release()

    def __enter__(self) -> "PooledWorker":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


class WorkerPool:
    """``size`` pre-warmed workers of one target (imports done once): :meth:`get` hands one
    out at once when one is idle. Only workers that come back clean (alive, nothing in
    flight, never killed, no abandoned call) are reused; others are ended and replaced in
    the background. Takes :func:`spawn`'s keyword arguments; ``zygote`` is on by default
    for a target (its workers and their replacements are forked from one zygote that
    imported torch once; a sandboxed one's are contained as they are forked),
    ``zygote=False`` execs each."""

    def __init__(self, target: Optional[str], size: int, **spawn_kwargs: Any) -> None:
        on_interrupt = spawn_kwargs.pop("on_interrupt", "kill")
        init_args, init_kwargs = spawn_kwargs.pop("init_args", None), spawn_kwargs.pop("init_kwargs", None)
        spawn_kwargs["env"] = _with_init(spawn_kwargs.get("env"), target, init_args, init_kwargs)
        kw = {**_SPAWN_DEFAULTS, **spawn_kwargs}
        if "zygote" not in spawn_kwargs:
            kw["zygote"] = kw["command"] is None
        spec = _spec(target, **kw)
        self._native = _native.WorkerPool(_on_interrupt(spec, on_interrupt), size)

    def get(self, timeout: Optional[float] = None) -> PooledWorker:
        """A warm worker: an idle one, else the next one released (clean) or started in
        the background. A worker is started here (cold) only while the pool — idle,
        starting and handed out — is below its size. With all of them handed out, waits
        up to ``timeout`` seconds (None: as long as it takes; Ctrl-C interrupts it), then
        raises :class:`tensorwire.Timeout`."""
        return PooledWorker(self._native.get(timeout))

    @property
    def idle(self) -> int:
        return self._native.idle()

    def wait_idle(self, n: int, timeout: float) -> bool:
        """Wait until ``n`` workers are idle (replacements started); whether they are."""
        return self._native.wait_idle(n, timeout)

    def close(self) -> None:
        self._native.close()

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


_SPAWN_DEFAULTS: dict[str, Any] = dict(command=None, python=None, env=None, cwd=None, output="inherit", prefix=None, capture_bytes=1 << 16,
                                       limits=None, sandbox=None, handshake_timeout=60.0, timeout=None, serve=None, path=None,
                                       zygote=False, preload=())
