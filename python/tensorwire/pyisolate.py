"""A pyisolate 0.10.2 adapter: tensors between a pyisolate host and its children travel
as tensorwire exports; the RPC stays pyisolate's.

    import pyisolate
    from tensorwire.pyisolate import TensorwireAdapter
    pyisolate.register_adapter(TensorwireAdapter())     # in the host, before loading extensions

pyisolate rehydrates the adapter in every child (``adapter_ref``), where
``setup_child_environment`` connects back to the host. Then:

- CPU tensors go as a tensorwire lease export of a sealed memfd segment. A tensor not
  yet in a segment has its storage moved into one in place on its first trip
  (:func:`tensorwire.share_`, as pyisolate's own path does with ``share_memory_()``), so
  later calls carrying it copy nothing. A tensor received from the peer is sent on as a
  copy (its memory is the peer's).
  CUDA tensors take tensorwire's CUDA path (IPC handle or VMM fd, ordered on streams).
- The JSON message carries only ``{"__type__": "TensorwireTensor", "tag": N}``; the
  tensor itself travels over a tensorwire connection beside pyisolate's socket.
- A child that dies (SIGKILL included) ends its connection: the host's leases for it are
  reclaimed and nothing is left in /dev/shm (memfd segments have no names).

How it plugs in (all through pyisolate's documented extension points, plus one wrapper):

- ``register_serializers`` registers a serializer for ``Tensor`` (consulted before
  pyisolate's own tensor handling). It cannot know where the message goes, so it returns
  a :class:`PendingExport` placeholder; the export happens when pyisolate's
  ``JSONSocketTransport.send`` encodes the placeholder (its JSON fallback consults the
  registry again), on the transport the message actually leaves through. To tell which
  transport that is, ``JSONSocketTransport.send``/``recv`` are wrapped once to record
  the transport in a thread-local while they run.
- The host listens on a Unix socket in a private directory (its path handed to children
  in ``$TENSORWIRE_PYISOLATE_SOCKET``); each child connects once. The host pairs a
  child's tensorwire connection with its pyisolate socket by the peer pid the kernel
  reports for both (SO_PEERCRED), so a child cannot claim another's connection.
- Where a transport has no tensorwire connection (a child without the adapter), the
  placeholder falls back to pyisolate's own tensor serialization.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import socket
import struct
import tempfile
import threading
from typing import Any, Optional

import torch

import tensorwire as _tw

from . import connection as _connection
from .connection import Connection, Listener
from .errors import Error, PeerGone, Timeout

__all__ = ["TensorwireAdapter", "PendingExport", "TYPE_NAME", "SOCKET_ENV"]

logger = logging.getLogger(__name__)

#: The ``__type__`` of a tensor reference in pyisolate's JSON.
TYPE_NAME = "TensorwireTensor"
#: Environment variable carrying the host's listener path to its children.
SOCKET_ENV = "TENSORWIRE_PYISOLATE_SOCKET"
#: How long a receiver waits for a tensor its message names (it was sent first).
RECV_TIMEOUT_S = 30.0
#: How long the host waits for a child's tensorwire connection to show up.
CONNECT_WAIT_S = 10.0
#: How often the host's accept loop looks whether it is closing (a blocked accept would
#: keep the listener, and its socket file, alive).
ACCEPT_POLL_S = 1.0
#: How long an accepted child has for its handshake (it has imported torch already).
ACCEPT_HANDSHAKE_S = 10.0
#: How long closing the host waits for its accept thread to leave the listener (a
#: handshake under way, at most ACCEPT_HANDSHAKE_S, finishes first).
CLOSE_JOIN_S = ACCEPT_HANDSHAKE_S + 5.0
#: Tensors received ahead of the message naming them that one connection may hold.
MAX_STASHED = 1024

_local = threading.local()


def _tensor_of(t: torch.Tensor) -> torch.Tensor:
    return t


class PendingExport:
    """A tensor on its way out: pyisolate's transport turns it into a tensorwire export
    when it encodes the message (see the module docstring). Pickled (pyisolate's
    queue-based transports), it is the plain tensor again."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def __reduce__(self) -> tuple[Any, tuple[torch.Tensor]]:
        return (_tensor_of, (self.tensor,))


class _Link:
    """One tensorwire connection to a peer and the tensors received ahead of the JSON
    message that names them (messages from several threads may overtake each other)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.tags = itertools.count(1)
        self.send_lock = threading.Lock()
        self.recv_lock = threading.Lock()
        self.stash: dict[int, torch.Tensor] = {}

    def export(self, tensor: torch.Tensor) -> dict[str, Any]:
        if not tensor.is_cuda and not _tw.is_shared(tensor):
            try:
                _tw.share_(tensor)
            except Error:
                pass  # e.g. a view of an import: send copies it instead
        with self.send_lock:
            tag = next(self.tags)
            self.conn.send(tensor, tag)
        return {"__type__": TYPE_NAME, "tag": tag}

    def take(self, tag: int) -> torch.Tensor:
        with self.recv_lock:
            while tag not in self.stash:
                if len(self.stash) >= MAX_STASHED:
                    raise Error(f"tensorwire.pyisolate: the peer sent {len(self.stash)} tensors that no message "
                                f"named (waiting for tag {tag}); refusing to hold more")
                t, got = self.conn.recv_tagged(timeout=RECV_TIMEOUT_S)
                self.stash[got] = t
            return self.stash.pop(tag)

    def close(self) -> None:
        self.stash.clear()
        self.conn.close()


def _peer_pid(sock: socket.socket) -> int:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[0]


class _Host:
    """The host side: a listener and the connections of its children, by pid."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="tensorwire-pyisolate-")
        os.chmod(self.dir, 0o700)
        self.path = os.path.join(self.dir, "tw.sock")
        self.listener: Optional[Listener] = _connection.listen(self.path)
        self.links: dict[int, _Link] = {}
        self.closing = False
        self.cv = threading.Condition()
        self.thread = threading.Thread(target=self._accept_loop, name="tensorwire-pyisolate-accept", daemon=True)
        self.thread.start()
        atexit.register(self.close)

    def _accept_loop(self) -> None:
        while True:
            try:
                listener = self.listener
                if listener is None or self.closing:
                    return
                conn = listener.accept(timeout=ACCEPT_POLL_S, handshake_timeout=ACCEPT_HANDSHAKE_S)
            except Timeout:
                # No child connected (or one connected and never finished its hello: it
                # sees the failure itself).
                if self.closing:
                    return
                continue
            except Error as e:
                if self.closing:
                    return
                logger.warning("tensorwire.pyisolate: a child's connection failed its handshake: %s", e)
                continue
            pid = conn.peer_pid
            with self.cv:
                if self.closing:
                    conn.close()
                    return
                old = self.links.pop(pid, None)
                self.links[pid] = _Link(conn)
                self._prune()
                self.cv.notify_all()
            if old is not None:
                old.close()

    def _prune(self) -> None:
        """Close the links of children that are gone (caller holds cv)."""
        for pid in [p for p in self.links if not _alive(p)]:
            self.links.pop(pid).close()

    def link_for(self, transport: Any) -> Optional[_Link]:
        # Cached on the transport, a miss too (False): a child without the adapter costs
        # one wait, not one per tensor.
        cached = getattr(transport, "_tensorwire_link", None)
        if cached is not None:
            return cached or None
        sock = getattr(transport, "_sock", None)
        if sock is None or sock.family != socket.AF_UNIX:
            return None
        pid = _peer_pid(sock)
        with self.cv:
            self.cv.wait_for(lambda: pid in self.links, timeout=CONNECT_WAIT_S)
            link = self.links.get(pid)
        if link is None:
            logger.warning("tensorwire.pyisolate: child %d has no tensorwire connection (adapter not loaded there?); "
                           "its tensors travel by pyisolate's own path", pid)
        transport._tensorwire_link = link or False
        return link

    def stats(self, prune: bool = True) -> dict[int, dict[str, int]]:
        with self.cv:
            if prune:
                self._prune()
            return {pid: link.conn.stats() for pid, link in self.links.items()}

    def close(self) -> None:
        """Stop accepting, end every child's connection, remove the listener (idempotent).

        The accept thread is joined before the listener goes, and this runs at interpreter
        exit too (``atexit``): a daemon thread still inside the accept op when the
        interpreter finalizes is ended by ``pthread_exit`` as it takes the GIL back, and
        that unwinds through C++ frames which may not be unwound (``terminate called
        without an active exception``, exit code 134)."""
        with self.cv:
            if self.closing and not self.thread.is_alive() and self.listener is None:
                return
            self.closing = True
            links, self.links = list(self.links.values()), {}
        self._wake_accept()
        if self.thread is not threading.current_thread():
            self.thread.join(CLOSE_JOIN_S)
            if self.thread.is_alive():
                logger.warning("tensorwire.pyisolate: the accept thread did not stop within %.0f s", CLOSE_JOIN_S)
        for link in links:
            link.close()
        listener, self.listener = self.listener, None
        if listener is not None:
            listener.close()
        try:
            os.rmdir(self.dir)
        except OSError:
            pass

    def _wake_accept(self) -> None:
        """End a blocked ``accept`` now rather than at its next poll: a connection that
        closes before its hello makes it fail at once (the loop then sees ``closing``)."""
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(1.0)
                s.connect(self.path)
        except OSError:
            pass  # not listening any more: the thread is leaving anyway


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (killed, not yet reaped) still answers kill(0); its /proc state says Z.
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


class _Child:
    """The child side: one connection to the host."""

    def __init__(self, path: str) -> None:
        self.link = _Link(_connection.connect(path))

    def link_for(self, transport: Any) -> Optional[_Link]:
        return self.link


_side: Optional[Any] = None  # _Host or _Child, once set up in this process
_side_lock = threading.Lock()


def _current_link() -> Optional[_Link]:
    transport = getattr(_local, "transport", None)
    side = _side
    if transport is None or side is None:
        return None
    return side.link_for(transport)


def _serialize_tensor(t: torch.Tensor) -> Any:
    """Registry serializer for ``Tensor``: defer to the transport that sends it."""
    return PendingExport(t)


def _export_pending(p: PendingExport) -> Any:
    """Registry serializer for :class:`PendingExport`: outside a transport's send (the
    eager serialization pass) it stays a placeholder; inside, it becomes an export."""
    if getattr(_local, "transport", None) is None:
        return p
    link = _current_link()
    if link is None:
        return p.tensor  # no tensorwire peer: pyisolate serializes the tensor itself
    return link.export(p.tensor)


def _deserialize(ref: Any) -> Any:
    """Registry deserializer for ``TensorwireTensor``: the tensor its tag names."""
    tag = ref.get("tag") if isinstance(ref, dict) else None
    if type(tag) is not int or tag <= 0:
        raise Error(f"tensorwire.pyisolate: a TensorwireTensor reference needs a positive int tag, got {tag!r}")
    link = _current_link()
    if link is None:
        raise Error("tensorwire.pyisolate: a TensorwireTensor arrived outside a transport with a tensorwire "
                    "connection (is the adapter registered on both sides?)")
    return link.take(tag)


def _wrap_transport() -> None:
    """Record the transport in a thread-local while it sends or receives (once)."""
    from pyisolate._internal.rpc_transports import JSONSocketTransport

    if getattr(JSONSocketTransport, "_tensorwire_wrapped", False):
        return
    orig_send, orig_recv = JSONSocketTransport.send, JSONSocketTransport.recv

    def send(self: Any, obj: Any) -> None:
        prev, _local.transport = getattr(_local, "transport", None), self
        try:
            orig_send(self, obj)
        finally:
            _local.transport = prev

    def recv(self: Any) -> Any:
        prev, _local.transport = getattr(_local, "transport", None), self
        try:
            return orig_recv(self)
        finally:
            _local.transport = prev

    JSONSocketTransport.send, JSONSocketTransport.recv = send, recv  # type: ignore[method-assign]
    JSONSocketTransport._tensorwire_wrapped = True  # type: ignore[attr-defined]


class TensorwireAdapter:
    """pyisolate ``IsolationAdapter``: register it in the host with
    ``pyisolate.register_adapter(TensorwireAdapter())`` before loading extensions.
    Constructed in the host, it starts listening for children (and sets
    ``$TENSORWIRE_PYISOLATE_SOCKET`` for them); rehydrated in a child
    (``$PYISOLATE_CHILD``), it connects in :meth:`setup_child_environment`."""

    identifier = "tensorwire"

    def __init__(self) -> None:
        global _side
        _wrap_transport()
        if os.environ.get("PYISOLATE_CHILD"):
            return
        with _side_lock:
            if _side is None:
                _side = _Host()
                os.environ[SOCKET_ENV] = _side.path

    # --- IsolationAdapter ----------------------------------------------------------

    def get_path_config(self, module_path: str) -> Optional[dict[str, Any]]:
        """No path changes."""
        return None

    def setup_child_environment(self, snapshot: dict[str, Any]) -> None:
        """In the child: connect to the host's listener (once)."""
        global _side
        path = os.environ.get(SOCKET_ENV)
        if not path:
            logger.warning("tensorwire.pyisolate: $%s is not set; tensors travel by pyisolate's own path", SOCKET_ENV)
            return
        with _side_lock:
            if _side is None:
                _side = _Child(path)

    def register_serializers(self, registry: Any) -> None:
        """Tensors (and their placeholders) out, ``TensorwireTensor`` references in."""
        registry.register("Tensor", _serialize_tensor, None, data_type=True)
        registry.register(PendingExport.__name__, _export_pending, None)
        registry.register(TYPE_NAME, lambda ref: ref, _deserialize)

    def setup_web_directory(self, module: Any) -> None:
        """Nothing to serve."""

    def provide_rpc_services(self) -> list[Any]:
        """No services of its own."""
        return []

    def handle_api_registration(self, api: Any, rpc: Any) -> None:
        """Nothing to do per API."""

    def setup_child_event_hooks(self, extension: Any) -> None:
        """No event hooks."""

    def get_sandbox_system_paths(self) -> Optional[list[str]]:
        """The listener's directory must be reachable from a sandboxed child."""
        path = os.environ.get(SOCKET_ENV)
        return [os.path.dirname(path)] if path else None

    def get_sandbox_gpu_patterns(self) -> Optional[list[str]]:
        """pyisolate's defaults."""
        return None

    # --- introspection -------------------------------------------------------------

    @staticmethod
    def host_stats(prune: bool = True) -> dict[int, dict[str, int]]:
        """In the host: lease counters (``Connection.stats``) per child pid. With
        ``prune`` (default), connections of children that are gone are closed and
        left out first."""
        side = _side
        return side.stats(prune) if isinstance(side, _Host) else {}
