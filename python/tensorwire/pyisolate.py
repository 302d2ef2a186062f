"""A pyisolate 0.10.2 adapter: tensors between a pyisolate host and its children travel
as tensorwire exports; the RPC stays pyisolate's.

    import pyisolate
    from tensorwire.pyisolate import TensorwireAdapter, compose
    pyisolate.register_adapter(TensorwireAdapter())     # in the host, before loading extensions
    # or, beside the host's own adapter (pyisolate holds one):
    pyisolate.register_adapter(compose(MyHostAdapter()))

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
  in ``$TENSORWIRE_PYISOLATE_SOCKET``); each child connects once, during its bootstrap.
- **Pairing is agreed on pyisolate's own socket.** A child holding a tensorwire
  connection says ``hello`` (``{"kind": "tensorwire", "op": "hello"}``) before anything
  else it sends there. The host takes the child's tensorwire connection by the peer pid
  the kernel reports for both sockets (SO_PEERCRED, with the process's start time, so a
  reused pid is not mistaken), waiting a bounded time for its accept to land, and
  answers ``ack``. The host sends references on that transport only after its ``ack``
  left; the child only after the ``ack`` arrived. Until then both use pyisolate's own
  tensor path, which both always read: nothing waits on the send path, and a slow child
  costs nothing but the tensors sent before it was ready. pyisolate's receive loop
  ignores a ``kind`` it does not know, and the wrapped ``recv`` consumes these messages
  before it sees them.
- Children that will not connect are known from pyisolate's bootstrap message (a sealed
  worker gets no ``adapter_ref``, or does not run ``setup_child_environment``; a
  ``share_torch=False`` child is told not to import torch): the host expects no hello
  from them and says nothing.
- Nothing the adapter raises while pyisolate receives ends pyisolate's receive loop: a
  reference that cannot be taken turns its message into an error (a response fails its
  call; a call or callback is answered with an error response).
- :func:`compose` wraps a host's own adapter, so both serve: the composite's class name
  carries the host adapter's ``module:Class``, and pyisolate's rehydration in the child
  (``module:Class`` with no arguments) rebuilds the same composite around a new instance
  of the host's adapter.
- The listener's directory is named after the host's pid and start time; a host start
  removes the directories of hosts that are gone (a killed host cannot remove its own).
"""

from __future__ import annotations

import atexit
import importlib
import itertools
import logging
import os
import re
import socket
import struct
import tempfile
import threading
from typing import Any, Callable, Optional

import torch

import tensorwire as _tw

from . import connection as _connection
from .connection import Connection, Listener
from .errors import Error, Timeout

__all__ = ["TensorwireAdapter", "ComposedAdapter", "compose", "PendingExport", "TYPE_NAME", "SOCKET_ENV",
           "CONTROL_KIND"]

logger = logging.getLogger(__name__)

#: The ``__type__`` of a tensor reference in pyisolate's JSON.
TYPE_NAME = "TensorwireTensor"
#: Environment variable carrying the host's listener path to its children.
SOCKET_ENV = "TENSORWIRE_PYISOLATE_SOCKET"
#: The ``kind`` of the pairing messages on pyisolate's socket.
CONTROL_KIND = "tensorwire"
#: Version of the pairing messages; a hello of another version is not answered.
PROTOCOL = 1
#: How long a receiver waits for a tensor its message names (it was sent first).
RECV_TIMEOUT_S = 30.0
#: How long the host, on a child's hello, waits for that child's tensorwire connection to
#: be accepted (the child connected before it said hello; only the host's accept thread
#: may still be on its way).
LINK_WAIT_S = 30.0
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
#: Prefix of the host's listener directory in the temp dir: ``<prefix><pid>-<start>-<random>``.
DIR_PREFIX = "tensorwire-pyisolate-"
_SOCK_NAME = "tw.sock"
_MAX_SOCK_PATH = 107
_DIR_RE = re.compile(re.escape(DIR_PREFIX) + r"(\d+)-(\d+)-[A-Za-z0-9_]+\Z")

_local = threading.local()


def _tensor_of(t: torch.Tensor) -> torch.Tensor:
    return t


class PendingExport:
    """A tensor on its way out: pyisolate's transport turns it into a tensorwire export
    when it encodes the message (see the module docstring), or, where the peer has not
    agreed to tensorwire, into what the host adapter's or pyisolate's own tensor
    serialization makes of it. Pickled (pyisolate's queue-based transports), it is the
    plain tensor again."""

    __slots__ = ("tensor", "fallback")

    def __init__(self, tensor: torch.Tensor, fallback: Optional[Callable[[Any], Any]] = None) -> None:
        self.tensor = tensor
        self.fallback = fallback

    def __reduce__(self) -> tuple[Any, tuple[torch.Tensor]]:
        return (_tensor_of, (self.tensor,))


class _Link:
    """One tensorwire connection to a peer and the tensors received ahead of the JSON
    message that names them (messages from several threads may overtake each other)."""

    def __init__(self, conn: Connection, start: Optional[int] = None) -> None:
        self.conn = conn
        self.start = start  # the peer process's start time when it connected (host side)
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


class _Pairing:
    """What one pyisolate transport agreed: ``link`` is set once both sides know the
    pairing is complete (host: its ack has left; child: the ack has arrived)."""

    __slots__ = ("lock", "link", "hello_sent", "expect", "seen_first")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.link: Optional[_Link] = None
        self.hello_sent = False  # child: said hello on this transport
        self.expect = False  # host: pyisolate's bootstrap says the child will connect
        self.seen_first = False  # host: a message other than a hello has arrived


_pairings_lock = threading.Lock()


def _pairing(transport: Any) -> _Pairing:
    p = getattr(transport, "_tensorwire", None)
    if p is None:
        with _pairings_lock:
            p = getattr(transport, "_tensorwire", None)
            if p is None:
                p = transport._tensorwire = _Pairing()
    return p


def _peer_pid(sock: socket.socket) -> int:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[0]


def _pid_of(transport: Any) -> Any:
    try:
        return _peer_pid(transport._sock)
    except (AttributeError, OSError):
        return "?"


def _start_time(pid: int) -> Optional[int]:
    """The process's start time (clock ticks after boot), or None if it is gone or a
    zombie: with the pid, it names one process (pids are reused, start times are not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if not fields or fields[0] in (b"Z", b"X"):
        return None
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def _remove_stale_dirs(tmp: str) -> None:
    """Remove the listener directories of hosts that are gone (a host killed by a signal
    or ``os._exit`` cannot remove its own). Only this user's directories holding nothing
    but the listener's socket are touched."""
    try:
        names = os.listdir(tmp)
    except OSError:
        return
    uid = os.getuid()
    for name in names:
        m = _DIR_RE.match(name)
        if m is None:
            continue
        pid, start = int(m.group(1)), int(m.group(2))
        if _start_time(pid) == start:
            continue  # its host is running
        path = os.path.join(tmp, name)
        try:
            st = os.lstat(path)
            if not os.path.isdir(path) or os.path.islink(path) or st.st_uid != uid:
                continue
            for entry in os.listdir(path):
                if entry != _SOCK_NAME:
                    raise OSError(f"unexpected {entry!r}")
                os.unlink(os.path.join(path, entry))
            os.rmdir(path)
        except OSError as e:
            logger.debug("tensorwire.pyisolate: left %s in place: %s", path, e)


class _Host:
    """The host side: a listener and the connections of its children, by pid."""

    def __init__(self) -> None:
        me = os.getpid()
        prefix = f"{DIR_PREFIX}{me}-{_start_time(me) or 0}-"
        tmp = tempfile.gettempdir()
        # A Unix socket's path has at most 107 bytes; a long $TMPDIR cannot hold one.
        if len(os.path.join(tmp, prefix + "x" * 8, _SOCK_NAME).encode()) > _MAX_SOCK_PATH:
            tmp = "/tmp"
        _remove_stale_dirs(tmp)
        self.dir = tempfile.mkdtemp(prefix=prefix, dir=tmp)
        os.chmod(self.dir, 0o700)
        self.path = os.path.join(self.dir, _SOCK_NAME)
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
            link = _Link(conn, _start_time(pid))
            with self.cv:
                if self.closing:
                    conn.close()
                    return
                old = self.links.pop(pid, None)
                self.links[pid] = link
                self._prune()
                self.cv.notify_all()
            if old is not None:
                old.close()

    def _prune(self) -> None:
        """Close the links of children that are gone (caller holds cv)."""
        for pid in [p for p, link in self.links.items() if link.start is None or _start_time(p) != link.start]:
            self.links.pop(pid).close()

    def pair(self, transport: Any) -> None:
        """A child said hello on ``transport``: take its tensorwire connection (the one
        from the same process), answer ``ack``, and from then on send references there."""
        p = _pairing(transport)
        if p.link is not None:
            return  # paired already: a second hello changes nothing
        sock = getattr(transport, "_sock", None)
        if sock is None or sock.family != socket.AF_UNIX:
            logger.warning("tensorwire.pyisolate: a hello on a transport that is not a Unix socket cannot be "
                           "paired; its tensors travel by pyisolate's own path")
            return
        pid = _peer_pid(sock)
        start = _start_time(pid)
        with self.cv:
            found = self.cv.wait_for(
                lambda: self.closing or start is None
                or (pid in self.links and self.links[pid].start == start),
                timeout=LINK_WAIT_S)
            link = self.links.get(pid) if found and start is not None and not self.closing else None
        if link is None or link.start != start:
            logger.warning("tensorwire.pyisolate: child %d said hello but its tensorwire connection did not "
                           "arrive within %g s (LINK_WAIT_S); its tensors travel by pyisolate's own path",
                           pid, LINK_WAIT_S)
            return
        _orig_send(transport, {"kind": CONTROL_KIND, "op": "ack", "version": PROTOCOL})
        p.link = link  # only now: every message encoded from here leaves after the ack

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
            self.cv.notify_all()
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


class _Child:
    """The child side: one connection to the host (None if connecting failed)."""

    def __init__(self, path: str) -> None:
        self.link: Optional[_Link] = None
        try:
            self.link = _Link(_connection.connect(path))
        except Error as e:
            logger.warning("tensorwire.pyisolate: cannot connect to the host's listener %s (%s); tensors travel "
                           "by pyisolate's own path", path, e)

    def announce(self, transport: Any) -> None:
        """Say hello on ``transport`` once, before anything else is sent there."""
        if self.link is None:
            return
        p = _pairing(transport)
        if p.hello_sent:
            return
        with p.lock:
            if not p.hello_sent:
                _orig_send(transport, {"kind": CONTROL_KIND, "op": "hello", "version": PROTOCOL})
                p.hello_sent = True


_side: Optional[Any] = None  # _Host or _Child, once set up in this process
_side_lock = threading.Lock()


def _send_link() -> Optional[_Link]:
    """The link a message being encoded may carry references over: only an agreed one."""
    p = getattr(getattr(_local, "transport", None), "_tensorwire", None)
    return p.link if p is not None else None


def _recv_link() -> Optional[_Link]:
    transport = getattr(_local, "transport", None)
    side = _side
    if transport is None:
        return None
    if isinstance(side, _Child):
        return side.link  # the host sends references only after this child's hello
    p = getattr(transport, "_tensorwire", None)
    return p.link if p is not None else None


def _export_pending(p: PendingExport) -> Any:
    """Registry serializer for :class:`PendingExport`: outside a transport's send (the
    eager serialization pass) it stays a placeholder; inside, it becomes an export where
    the pairing is agreed, else what the tensor is without tensorwire."""
    if getattr(_local, "transport", None) is None:
        return p
    link = _send_link()
    if link is not None:
        try:
            return link.export(p.tensor)
        except Error as e:
            logger.warning("tensorwire.pyisolate: export failed (%s); this tensor travels by pyisolate's own "
                           "path", e)
    return p.fallback(p.tensor) if p.fallback is not None else p.tensor


def _deserialize(ref: Any) -> Any:
    """Registry deserializer for ``TensorwireTensor``: the tensor its tag names.

    Inside a transport's ``recv`` it never raises (that would end pyisolate's receive
    loop): a failure is recorded for the wrapped ``recv``, which turns the message into
    an error."""
    failures = getattr(_local, "failures", None)
    try:
        tag = ref.get("tag") if isinstance(ref, dict) else None
        if type(tag) is not int or tag <= 0:
            raise Error(f"tensorwire.pyisolate: a TensorwireTensor reference needs a positive int tag, got {tag!r}")
        link = _recv_link()
        if link is None:
            raise Error("tensorwire.pyisolate: a TensorwireTensor arrived outside a transport with an agreed "
                        "tensorwire connection (the peer sent it before the pairing was acknowledged, or the "
                        "adapter is not registered on both sides)")
        return link.take(tag)
    except Exception as e:
        if failures is None:
            raise
        failures.append(str(e))
        return None


def _is_bootstrap(obj: Any) -> bool:
    return isinstance(obj, dict) and "snapshot" in obj and "config" in obj and "extension_type_ref" in obj


def _child_will_connect(bootstrap: dict) -> bool:
    """What pyisolate's bootstrap message tells: a child rehydrating this module's
    adapter, running its ``setup_child_environment`` (not a sealed worker) and allowed
    to import torch (``share_torch``)."""
    snapshot, config = bootstrap.get("snapshot") or {}, bootstrap.get("config") or {}
    ref = snapshot.get("adapter_ref") if isinstance(snapshot, dict) else None
    return (isinstance(ref, str) and ref.startswith(__name__ + ":")
            and snapshot.get("apply_host_sys_path", True) is not False
            and isinstance(config, dict) and bool(config.get("share_torch", False)))


def _on_control(transport: Any, msg: dict) -> None:
    """A pairing message, in pyisolate's receive thread: nothing may escape from here."""
    try:
        _handle_control(transport, msg)
    except Exception as e:  # e.g. the socket closed under the ack: pyisolate's recv sees that next
        logger.error("tensorwire.pyisolate: pairing message %r failed: %s", msg.get("op"), e)


def _handle_control(transport: Any, msg: dict) -> None:
    side, op = _side, msg.get("op")
    if msg.get("version") != PROTOCOL:
        logger.warning("tensorwire.pyisolate: ignoring a pairing message of version %r (this side speaks %d)",
                       msg.get("version"), PROTOCOL)
    elif isinstance(side, _Host) and op == "hello":
        side.pair(transport)
    elif isinstance(side, _Child) and op == "ack" and side.link is not None:
        _pairing(transport).link = side.link
    else:
        logger.debug("tensorwire.pyisolate: ignoring pairing message %r", op)


def _fail_message(transport: Any, item: Any, failures: list[str]) -> Any:
    """A received message whose tensors could not be taken: a response fails its call; a
    call or callback is answered with an error response and not run (None)."""
    msg = "; ".join(failures)
    kind = item.get("kind") if isinstance(item, dict) else None
    logger.error("tensorwire.pyisolate: a %s message could not be received: %s", kind, msg)
    if kind == "response":
        return {**item, "result": None, "error": msg}
    if kind in ("call", "callback") and "call_id" in item:
        try:
            _orig_send(transport, {"kind": "response", "call_id": item["call_id"], "result": None, "error": msg})
        except Exception as e:  # the socket closed: pyisolate's recv sees that next
            logger.error("tensorwire.pyisolate: cannot answer call %r: %s", item["call_id"], e)
    return None


_orig_send: Callable[[Any, Any], None]
_orig_recv: Callable[[Any], Any]


def _wrap_transport() -> None:
    """Record the transport in a thread-local while it sends or receives, and handle the
    pairing messages (once per process)."""
    global _orig_send, _orig_recv
    from pyisolate._internal.rpc_transports import JSONSocketTransport

    if getattr(JSONSocketTransport, "_tensorwire_wrapped", False):
        return
    _orig_send, _orig_recv = JSONSocketTransport.send, JSONSocketTransport.recv

    def send(self: Any, obj: Any) -> None:
        side = _side
        if isinstance(side, _Child):
            side.announce(self)
        elif isinstance(side, _Host) and _is_bootstrap(obj):
            _pairing(self).expect = _child_will_connect(obj)
        prev, _local.transport = getattr(_local, "transport", None), self
        try:
            _orig_send(self, obj)
        finally:
            _local.transport = prev

    def recv(self: Any) -> Any:
        side = _side
        if isinstance(side, _Child):
            try:
                side.announce(self)
            except OSError as e:  # the socket closed: pyisolate's recv below says so
                logger.debug("tensorwire.pyisolate: cannot say hello: %s", e)
        while True:
            prev, _local.transport = getattr(_local, "transport", None), self
            prev_failures, _local.failures = getattr(_local, "failures", None), []
            try:
                item = _orig_recv(self)
                failures = _local.failures
            finally:
                _local.transport, _local.failures = prev, prev_failures
            if isinstance(item, dict) and item.get("kind") == CONTROL_KIND:
                _on_control(self, item)
                continue
            if isinstance(side, _Host) and item is not None:
                p = _pairing(self)
                if not p.seen_first:
                    p.seen_first = True
                    if p.expect and p.link is None:
                        logger.warning("tensorwire.pyisolate: child %s did not pair its tensorwire connection "
                                       "(its log says why); its tensors travel by pyisolate's own path",
                                       _pid_of(self))
            if failures:
                item = _fail_message(self, item, failures)
                if item is None:
                    continue
            return item

    JSONSocketTransport.send, JSONSocketTransport.recv = send, recv
    JSONSocketTransport._tensorwire_wrapped = True


class _Recorder:
    """A serializer registry in front of pyisolate's: notes what the host adapter
    registers for ``Tensor`` (PendingExport falls back to it)."""

    def __init__(self, registry: Any) -> None:
        self._registry = registry
        self.tensor_serializer: Optional[Callable[[Any], Any]] = None

    def register(self, type_name: str, serializer: Any, deserializer: Any = None, **kw: Any) -> None:
        if type_name == "Tensor":
            self.tensor_serializer = serializer
        self._registry.register(type_name, serializer, deserializer, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._registry, name)


class TensorwireAdapter:
    """pyisolate ``IsolationAdapter``: register it in the host with
    ``pyisolate.register_adapter(TensorwireAdapter())`` before loading extensions.
    Constructed in the host, it starts listening for children (and sets
    ``$TENSORWIRE_PYISOLATE_SOCKET`` for them); rehydrated in a child
    (``$PYISOLATE_CHILD``), it connects in :meth:`setup_child_environment`.
    To keep a host's own adapter, register :func:`compose` of it instead."""

    _inner: Any = None

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

    def _hook(self, name: str) -> Optional[Callable[..., Any]]:
        """The host adapter's hook ``name``, if it has one (pyisolate treats several as
        optional, and so does the composite)."""
        return getattr(self._inner, name, None) if self._inner is not None else None

    @property
    def identifier(self) -> str:
        """``tensorwire``, or the composed host adapter's."""
        return self._inner.identifier if self._inner is not None else "tensorwire"

    def get_path_config(self, module_path: str) -> Optional[dict[str, Any]]:
        """The host adapter's; no path changes of its own."""
        hook = self._hook("get_path_config")
        return hook(module_path) if hook is not None else None

    def setup_child_environment(self, snapshot: dict[str, Any]) -> None:
        """In the child: the host adapter's set-up, then connect to the host's listener
        (once; not in a child pyisolate tells not to import torch)."""
        global _side
        hook = self._hook("setup_child_environment")
        if hook is not None:
            hook(snapshot)
        if os.environ.get("PYISOLATE_IMPORT_TORCH") == "0":
            return
        path = os.environ.get(SOCKET_ENV)
        if not path:
            logger.warning("tensorwire.pyisolate: $%s is not set; tensors travel by pyisolate's own path", SOCKET_ENV)
            return
        with _side_lock:
            if _side is None:
                _side = _Child(path)

    def register_serializers(self, registry: Any) -> None:
        """The host adapter's serializers, then: tensors (and their placeholders) out,
        ``TensorwireTensor`` references in. A ``Tensor`` serializer of the host
        adapter's is what a tensor becomes where tensorwire is not agreed."""
        fallback = None
        hook = self._hook("register_serializers")
        if hook is not None:
            recorder = _Recorder(registry)
            hook(recorder)
            fallback = recorder.tensor_serializer
        registry.register("Tensor", lambda t: PendingExport(t, fallback), None, data_type=True)
        registry.register(PendingExport.__name__, _export_pending, None)
        registry.register(TYPE_NAME, lambda ref: ref, _deserialize)

    def setup_web_directory(self, module: Any) -> None:
        """The host adapter's."""
        hook = self._hook("setup_web_directory")
        if hook is not None:
            hook(module)

    def provide_rpc_services(self) -> list[Any]:
        """The host adapter's; none of its own."""
        hook = self._hook("provide_rpc_services")
        return list(hook() or []) if hook is not None else []

    def handle_api_registration(self, api: Any, rpc: Any) -> None:
        """The host adapter's."""
        hook = self._hook("handle_api_registration")
        if hook is not None:
            hook(api, rpc)

    def setup_child_event_hooks(self, extension: Any) -> None:
        """The host adapter's."""
        hook = self._hook("setup_child_event_hooks")
        if hook is not None:
            hook(extension)

    def get_sandbox_system_paths(self) -> Optional[list[str]]:
        """The host adapter's, the listener's directory and this package's (a sandboxed
        child must reach the one and import the other, read-only both)."""
        hook = self._hook("get_sandbox_system_paths")
        paths = list((hook() if hook is not None else None) or [])
        path = os.environ.get(SOCKET_ENV)
        if path:
            paths.append(os.path.dirname(path))
        paths.append(os.path.dirname(os.path.abspath(_tw.__file__)))
        return paths

    def get_sandbox_gpu_patterns(self) -> Optional[list[str]]:
        """The host adapter's (None: pyisolate's defaults)."""
        hook = self._hook("get_sandbox_gpu_patterns")
        return hook() if hook is not None else None

    # --- introspection -------------------------------------------------------------

    @staticmethod
    def host_stats(prune: bool = True) -> dict[int, dict[str, int]]:
        """In the host: lease counters (``Connection.stats``) per child pid. With
        ``prune`` (default), connections of children that are gone are closed and
        left out first."""
        side = _side
        return side.stats(prune) if isinstance(side, _Host) else {}


class ComposedAdapter(TensorwireAdapter):
    """A host adapter and tensorwire's, serving together (see :func:`compose`). Its
    concrete classes are made per host adapter class; their name,
    ``Composed[module:Class]``, is what pyisolate's ``adapter_ref`` carries to the
    child, where this module rebuilds the class by that name and the composite
    rehydrates the host adapter as pyisolate would have: ``Class()``."""

    _inner_ref = ""

    def __init__(self, inner: Any = None) -> None:
        super().__init__()
        if inner is None:
            inner = _import_ref(self._inner_ref)()
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        # The host's own methods beyond the protocol (it may fetch its adapter back from
        # pyisolate's registry and call them).
        inner = self.__dict__.get("_inner")
        if inner is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(inner, name)

    @property
    def inner(self) -> Any:
        """The host adapter."""
        return self._inner


_composed: dict[str, type] = {}
_composed_lock = threading.Lock()
_COMPOSED_RE = re.compile(r"Composed\[([A-Za-z_][\w.]*:[A-Za-z_][\w.]*)\]\Z")


def _import_ref(ref: str) -> Any:
    module, _, qualname = ref.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _composed_class(ref: str) -> type:
    with _composed_lock:
        cls = _composed.get(ref)
        if cls is None:
            name = f"Composed[{ref}]"
            cls = type(name, (ComposedAdapter,), {"_inner_ref": ref, "__module__": __name__, "__qualname__": name})
            _composed[ref] = cls
        return cls


def compose(host_adapter: Any) -> ComposedAdapter:
    """An adapter serving ``host_adapter`` and tensorwire together, to register with
    pyisolate (which holds one adapter) in place of ``host_adapter``:

        pyisolate.register_adapter(tensorwire.pyisolate.compose(MyHostAdapter()))

    Every hook runs the host adapter's; tensorwire adds its serializers (after the host
    adapter's: a ``Tensor`` serializer of the host adapter's still serves where a child
    has no tensorwire connection), its child connection and its listener's sandbox path.
    In each child, pyisolate rehydrates the composite, which makes the host adapter as
    pyisolate would: its class called with no arguments, so that class must be
    importable by module and name (not defined in ``__main__`` or a function)."""
    if isinstance(host_adapter, TensorwireAdapter):
        raise ValueError("tensorwire.pyisolate.compose: the adapter is tensorwire's already; register it as is")
    cls = type(host_adapter)
    ref = f"{cls.__module__}:{cls.__qualname__}"
    try:
        importable = cls.__module__ != "__main__" and _COMPOSED_RE.match(f"Composed[{ref}]") is not None \
            and _import_ref(ref) is cls
    except (ImportError, AttributeError):
        importable = False
    if not importable:
        raise ValueError(f"tensorwire.pyisolate.compose: {ref} cannot be rehydrated in a child (pyisolate imports "
                         "the adapter's class by module and name there); define it in an importable module")
    return _composed_class(ref)(host_adapter)


def __getattr__(name: str) -> Any:
    """``Composed[module:Class]``: the composite class pyisolate's rehydration asks for."""
    m = _COMPOSED_RE.match(name)
    if m is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return _composed_class(m.group(1))
