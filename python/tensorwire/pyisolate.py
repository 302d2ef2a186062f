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

This module is the pyisolate half (the adapter, its serializers, the wrapped transport);
the connections, their pairing state, the listener and its directory are
:mod:`tensorwire._pyisolate_link`'s.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import threading
from typing import Any, Callable, Optional

import torch

import tensorwire as _tw

from ._pyisolate_link import CONTROL_KIND, PROTOCOL, TYPE_NAME, _Child, _Host, _Link, _pairing, _pid_of
from .errors import Error

__all__ = ["TensorwireAdapter", "ComposedAdapter", "compose", "PendingExport", "TYPE_NAME", "SOCKET_ENV",
           "CONTROL_KIND"]

logger = logging.getLogger(__name__)

#: Environment variable carrying the host's listener path to its children.
SOCKET_ENV = "TENSORWIRE_PYISOLATE_SOCKET"

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
                _side = _Host(_orig_send)
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
                _side = _Child(path, _orig_send)

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
