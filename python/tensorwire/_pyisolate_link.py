"""The tensorwire half of the pyisolate adapter (:mod:`tensorwire.pyisolate`): the
connection between a host and each child, the tensors on it, the pairing state of each
pyisolate transport, the host's listener and the child's connection to it, and the
listener directories of hosts that are gone. It knows nothing of pyisolate's serializers
or of how its transport is wrapped: a side is handed the transport's unwrapped ``send``,
which says ``hello`` and ``ack`` on pyisolate's socket."""

from __future__ import annotations

import atexit
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

# The adapter's logger, whichever of its modules logs: one name to configure.
logger = logging.getLogger("tensorwire.pyisolate")

#: The ``__type__`` of a tensor reference in pyisolate's JSON.
TYPE_NAME = "TensorwireTensor"
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


# pyisolate's ``JSONSocketTransport.send`` as it was before the adapter wrapped it.
RawSend = Callable[[Any, Any], None]


class _Host:
    """The host side: a listener and the connections of its children, by pid.
    ``send_raw`` sends the ``ack`` on a child's pyisolate transport."""

    def __init__(self, send_raw: RawSend) -> None:
        self.send_raw = send_raw
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
        self.send_raw(transport, {"kind": CONTROL_KIND, "op": "ack", "version": PROTOCOL})
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
    """The child side: one connection to the host (None if connecting failed).
    ``send_raw`` sends the ``hello`` on the pyisolate transport."""

    def __init__(self, path: str, send_raw: RawSend) -> None:
        self.send_raw = send_raw
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
                self.send_raw(transport, {"kind": CONTROL_KIND, "op": "hello", "version": PROTOCOL})
                p.hello_sent = True
