"""Connections and listeners: one end of a tensorwire link between two processes.

Every blocking method takes ``timeout``: seconds (a float), ``None`` for no limit, ``0``
to not wait (what is ready is taken, else :class:`tensorwire.Timeout` at once). Every other
time in this module is in seconds too (``window``, ``handshake_timeout``,
``cuda_wait_timeout``); the older millisecond names (``window_ms``,
``handshake_timeout_ms``, ``cuda_wait_timeout_ms``) still work and warn
(``DeprecationWarning``)."""

from __future__ import annotations

import math
import warnings
from types import TracebackType
from typing import Any, Callable, Optional, TypeVar

import torch

from . import _native
from ._loader import BACKEND, ops
from .errors import translate

__all__ = ["Connection", "Listener", "socketpair", "from_fd", "connect", "listen"]

if BACKEND == "native":
    # The ops' own Python implementations: the hot path does not pay the dispatcher.
    from . import _ops

    _send, _recv, _stats = _ops.send, _ops.recv, _ops.stats
    _ring_send, _ring_recv, _cuda_ring_recv = _ops.ring_send, _ops.ring_recv, _ops.cuda_ring_recv
    # Also what __del__ calls: at interpreter exit torch 2.11's dispatcher may already be torn
    # down, and calling a Python-registered op through it then crashes (SIGSEGV).
    _close, _close_listener = _ops.close, _ops.close_listener
else:
    # The C++ extension's bound overloads: calling them skips the overload-packet lookup
    # (~1 us per call).
    _send, _recv, _stats = ops.send.default, ops.recv.default, ops.stats.default
    _ring_send, _ring_recv = ops.ring_send.default, ops.ring_recv.default
    _cuda_ring_recv = ops.cuda_ring_recv.default
    _close, _close_listener = ops.close.default, ops.close_listener.default

_STATS = ("live_leases", "live_bytes", "granted", "released", "expired", "reclaimed")


_MAX_MS = 2**63 - 1


def _ms(timeout: Optional[float]) -> int:
    """``timeout`` in the C ABI's ``timeout_ms``: -1 no limit, 0 do not wait; a positive
    timeout rounds up (0.0001 s still waits), one too long for int64 ms is no limit."""
    if timeout is None:
        return -1
    if not timeout >= 0:  # also NaN
        raise ValueError(f"timeout must be None or a non-negative number of seconds, got {timeout!r}")
    if math.isinf(timeout) or timeout * 1000 >= _MAX_MS:
        return -1
    return math.ceil(timeout * 1000)


def _positive_ms(name: str, seconds: float) -> int:
    """A positive number of seconds as whole ms (rounded up), for an option in ms."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {seconds!r}")
    if math.isinf(seconds) or seconds * 1000 >= _MAX_MS:
        raise ValueError(f"{name} must be a finite number of seconds, got {seconds!r}")
    return max(1, math.ceil(seconds * 1000))


def _deprecated_ms(old: str, new: str, stacklevel: int) -> None:
    warnings.warn(f"tensorwire: {old} (milliseconds) is deprecated; pass {new}= in seconds instead",
                  DeprecationWarning, stacklevel=stacklevel + 1)


_C = TypeVar("_C", bound="_Closing")


class _Closing:
    """``with`` support and close-on-collect for handles with an idempotent ``close()``."""

    close: Callable[[], None]  # each handle's own, idempotent

    def __enter__(self: _C) -> _C:
        return self

    def __exit__(self, exc_type: Optional[type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


class Connection(_Closing):
    """One end of a tensorwire connection (from :func:`from_fd`, :func:`connect` or
    :meth:`Listener.accept`). A context manager: leaving the ``with`` block closes it,
    which ends every lease it granted; the peer sees the connection end. Failures raise
    :class:`tensorwire.Error` subclasses (``PeerGone``, ``Timeout``, ``Refused``, ...)."""

    def __init__(self, handle: int) -> None:
        self._h = handle

    def send(self, tensor: torch.Tensor, tag: int = 0, window_ms: Optional[int] = None, *,
             window: Optional[float] = None) -> bool:
        """Export ``tensor`` (any strided view, CPU or CUDA) under a lease; returns True
        if it went zero-copy (it lives in a tensorwire segment, came from ``recv`` and is
        forwarded as the same memory, or is CUDA memory), False if it was copied once into
        a new segment. ``tag`` (>= 0) travels with it; ``window`` (seconds, > 0) bounds
        how long the peer may hold it (``None``: the connection's ``window``, by default
        no bound). ``window_ms`` is the deprecated millisecond spelling."""
        return self._send(tensor, tag, window_ms, window, stacklevel=2)

    def _send(self, tensor: torch.Tensor, tag: int, window_ms: Optional[int], window: Optional[float],
              stacklevel: int) -> bool:
        if window_ms is not None:
            if window is not None:
                raise TypeError("send() takes window (seconds) or the deprecated window_ms, not both")
            _deprecated_ms("window_ms", "window", stacklevel + 1)
            ms = window_ms  # the op checks it (>= 0; 0: the connection's window)
        else:
            ms = 0 if window is None else _positive_ms("window", window)
        try:
            return _send(self._h, tensor, tag, ms)
        except RuntimeError as e:
            raise translate(e) from e

    def recv_tagged(self, timeout: Optional[float] = None) -> tuple[torch.Tensor, int]:
        """The next tensor and its tag. The tensor (CPU, or CUDA on the device the
        peer's memory is on) aliases the peer's memory; the lease is released when the
        last view of it dies. ``timeout`` in seconds (None: no limit)."""
        try:
            t, tag = _recv(self._h, _ms(timeout))
        except RuntimeError as e:
            raise translate(e) from e
        if t.is_cuda:
            torch.cuda.init()  # PyTorch's Python-side CUDA state (no-op once initialized)
        return t, tag

    def recv(self, timeout: Optional[float] = None) -> torch.Tensor:
        """The next tensor (see :meth:`recv_tagged`), without its tag."""
        return self.recv_tagged(timeout)[0]

    def ring_send(self, tensor: torch.Tensor, tag: int = 0, timeout: Optional[float] = None) -> None:
        """Copy ``tensor`` (any strides) through the ring, packed; waits at most
        ``timeout`` seconds for ring space (None: no limit). A CPU tensor takes the CPU
        ring (the peer's :meth:`ring_recv`), a CUDA tensor the GPU ring (the peer's
        :meth:`cuda_ring_recv`; open this side with ``cuda_ring_device=<index>``)."""
        try:
            _ring_send(self._h, tensor, tag, _ms(timeout))
        except RuntimeError as e:
            raise translate(e) from e

    def ring_recv_tagged(self, timeout: Optional[float] = None) -> tuple[torch.Tensor, int]:
        """The next CPU ring tensor and its tag: contiguous, owning its (private) bytes."""
        try:
            return _ring_recv(self._h, _ms(timeout))
        except RuntimeError as e:
            raise translate(e) from e

    def ring_recv(self, timeout: Optional[float] = None) -> torch.Tensor:
        """The next CPU ring tensor (see :meth:`ring_recv_tagged`), without its tag."""
        return self.ring_recv_tagged(timeout)[0]

    def cuda_ring_recv_tagged(self, timeout: Optional[float] = None) -> tuple[torch.Tensor, int]:
        """The next tensor from the peer's GPU ring and its tag: a fresh contiguous CUDA
        tensor, filled on the current stream after it waited for the peer's copy (no
        device synchronize)."""
        try:
            t, tag = _cuda_ring_recv(self._h, _ms(timeout))
        except RuntimeError as e:
            raise translate(e) from e
        if t.is_cuda:
            torch.cuda.init()
        return t, tag

    def cuda_ring_recv(self, timeout: Optional[float] = None) -> torch.Tensor:
        """The next GPU ring tensor (see :meth:`cuda_ring_recv_tagged`), without its tag."""
        return self.cuda_ring_recv_tagged(timeout)[0]

    def stats(self) -> dict[str, int]:
        """This side's lease counters for what it exported: ``live_leases``,
        ``live_bytes``, ``granted``, ``released``, ``expired``, ``reclaimed``."""
        try:
            return dict(zip(_STATS, _stats(self._h)))
        except RuntimeError as e:
            raise translate(e) from e

    @property
    def peer_pid(self) -> int:
        """The other process's pid (from the kernel: SO_PEERCRED / SCM_CREDENTIALS)."""
        try:
            return ops.peer_pid(self._h)
        except RuntimeError as e:
            raise translate(e) from e

    @property
    def handle(self) -> int:
        """The extension's int handle of this connection (for ``torch.ops.tensorwire.*``)."""
        return self._h

    def close(self) -> None:
        """End the connection (idempotent); later calls raise :class:`tensorwire.Error`."""
        _close(self._h)



class Listener(_Closing):
    """A listening Unix socket (from :func:`listen`); :meth:`accept` takes one
    connection. A context manager: leaving the ``with`` block closes it."""

    def __init__(self, handle: int) -> None:
        self._h = handle

    def accept(self, timeout: Optional[float] = None, **limits: Any) -> Connection:
        """Wait for one connection (at most ``timeout`` seconds; None: no limit) and
        handshake with it (limits as in :func:`from_fd`)."""
        try:
            return Connection(ops.accept(self._h, timeout_ms=_ms(timeout), **_options(limits)))
        except RuntimeError as e:
            raise translate(e) from e

    def close(self) -> None:
        """Stop listening and remove the socket file (idempotent)."""
        _close_listener(self._h)



# The connection options the ops take, from the library's table: name -> the names of its
# values 0, 1, ... where it is a choice.
_OPTIONS = {name: tuple(choices) for name, _type, _min, _max, _default, _doc, choices in _native.connection_options()}
# cuda_wait by name: the option's choices, numbered in order.
_CUDA_WAIT = {name: i for i, name in enumerate(_OPTIONS["cuda_wait"])}


#: The handshake's default bound in Python, seconds per setup step (the Rust and C
#: default is 10 s). The first step waits for the peer's hello, which a child started
#: just now sends only after ``import torch``: 4.1 s warm and 5-6 s with torch's files
#: out of the page cache on a busy 2-core machine (torch 2.15.0), so 10 s left a
#: correct child timing out under load. 60 s is ten times the cold import.
HANDSHAKE_TIMEOUT_S = 60.0

# Deprecated millisecond option -> its name in seconds (every option in ms has one).
_MS_ALIASES = {name: name[:-3] for name in _OPTIONS if name.endswith("_ms")}


def _options(limits: dict, stacklevel: int = 2) -> dict:
    """The connection options as the ops take them: ``cuda_wait`` by name
    (``"stream"``, ``"host"``, ``"event"``); the times in seconds as the ops' ms:
    ``window`` (> 0: the window of every send that names none; ``None``: none),
    ``handshake_timeout`` (> 0; ``None``: no limit; left out: ``HANDSHAKE_TIMEOUT_S``)
    and ``cuda_wait_timeout`` (> 0; ``None``: no limit). Other options left out take the
    library's default. The deprecated ``*_ms`` spellings pass through as they are, with a
    ``DeprecationWarning`` pointing at the caller ``stacklevel`` frames up."""
    opts = dict(limits)
    if "handshake_timeout" not in opts and "handshake_timeout_ms" not in opts:
        opts["handshake_timeout"] = HANDSHAKE_TIMEOUT_S
    for old, new in _MS_ALIASES.items():
        if old in opts:
            if new in opts:
                raise TypeError(f"pass {new} (seconds) or the deprecated {old}, not both")
            _deprecated_ms(old, new, stacklevel + 1)
    if "cuda_wait" in opts:
        w = opts["cuda_wait"]
        if w not in _CUDA_WAIT:
            raise ValueError(f"cuda_wait must be one of {sorted(_CUDA_WAIT)}, got {w!r}")
        opts["cuda_wait"] = _CUDA_WAIT[w]
    if "window" in opts:
        t = opts.pop("window")
        opts["window_ms"] = 0 if t is None else _positive_ms("window", t)
    for name in _MS_ALIASES.values():
        if name != "window" and name in opts:
            t = opts.pop(name)
            opts[name + "_ms"] = -1 if t is None else _positive_ms(name, t)
    return opts


def socketpair(inheritable_child: bool = True) -> tuple[int, int]:
    """Two connected fds: keep the first, hand the second to the child process (it is
    inheritable unless ``inheritable_child`` is False); each side calls :func:`from_fd`."""
    try:
        a, b = ops.socketpair()
        if inheritable_child:
            ops.set_inheritable(b, True)
    except RuntimeError as e:
        raise translate(e) from e
    return a, b


def from_fd(fd: int, **limits: Any) -> Connection:
    """Handshake over an end of :func:`socketpair` (takes ownership of ``fd``).

    ``handshake_timeout`` (seconds, default 60; ``None``: no limit) bounds each setup
    step, the first of which is waiting for the peer's hello: a child started just now
    says hello only once it has imported torch and tensorwire, and that wait is charged
    here (see ``HANDSHAKE_TIMEOUT_S``). A peer that exits or closes its end ends the wait
    at once (:class:`tensorwire.PeerGone`). Limits:
    ``max_leases``, ``max_lease_bytes``, ``window`` (seconds: the window of every send
    that names none), ``handshake_timeout``, ``ring_bytes`` (this side's send ring, a power of two >= 4096) (0: library default);
    ``cuda_ring_device`` (>= 0: a GPU bounce ring on that device for this side's CUDA
    ``ring_send``s; needs a driver), ``cuda_ring_slot_bytes``, ``cuda_ring_slots``;
    ``cuda_wait`` — how this side waits for the peer's CUDA work: ``"stream"`` (default:
    the GPU waits on the peer's signal word, ``recv`` returns at once), ``"host"`` (``recv``
    waits until the peer's work completed: lowest latency), ``"event"`` (the stream waits
    on the peer's IPC event: slow without MPS); ``cuda_wait_timeout`` (seconds, default
    30; ``None``: no limit) bounds that wait."""
    opts = _options(limits)
    try:
        return Connection(ops.from_fd(fd, **opts))
    except RuntimeError as e:
        raise translate(e) from e


def connect(path: str, **limits: Any) -> Connection:
    """Connect to a :func:`listen`-ing process at ``path`` (limits as in :func:`from_fd`)."""
    try:
        return Connection(ops.connect(path, **_options(limits)))
    except RuntimeError as e:
        raise translate(e) from e


def listen(path: str) -> Listener:
    """Listen on a new Unix socket at ``path``."""
    try:
        return Listener(ops.listen(path))
    except RuntimeError as e:
        raise translate(e) from e
