"""tensorwire's exceptions, mapped from the C ABI's result codes (``tw_result_e`` in
ffi/include/tensorwire.h).

The extension reports a failed ``tw_*`` call as a c10 error whose message starts with a
stable prefix naming the code: ``"tensorwire (TW_ERR_PEER_GONE): <what was wrong>"``
(``TW_CHECK`` in cpp/src/common.h). :func:`translate` reads that prefix and raises the
matching class below; a failure without the prefix (an argument the extension itself
refused, a closed handle) and any code this table does not know become the base
:class:`Error`. Every class derives from ``RuntimeError``, so code written against the
older API (which raised plain ``RuntimeError``) keeps working.

Which class each code raises is the library's table (``RESULT_CODES`` in Rust, read here
through ``_native.result_codes()``); a new code is mapped there.
"""

from __future__ import annotations

import re
from typing import Optional

from . import _native

__all__ = ["Error", "PeerGone", "Timeout", "Refused", "QuotaExceeded", "ResourceExhausted", "CudaUnavailable", "RemoteError", "CODES", "BASE_CODES", "translate"]


class Error(RuntimeError):
    """Any tensorwire failure. ``code`` is the C ABI's result name (``"TW_ERR_IO"``,
    ...) when the failure came from the library, else None; the message says what was
    wrong and, where it can, what to do."""

    def __init__(self, message: str, code: Optional[str] = None) -> None:
        super().__init__(message)
        self.code = code


class PeerGone(Error):
    """The other process closed the connection or died (``TW_ERR_PEER_GONE``)."""


class Timeout(Error):
    """A bounded wait ran out (``TW_ERR_TIMEOUT``): nothing arrived, or no ring space
    freed up, within the timeout."""


class Refused(Error):
    """Hostile or invalid input from the peer or the caller was refused: a protocol
    violation, a descriptor or segment that does not check out, a stale lease, a bad
    argument (``TW_ERR_PROTOCOL``, ``TW_ERR_INVALID_DESCRIPTOR``,
    ``TW_ERR_INVALID_SEGMENT``, ``TW_ERR_INVALID_ARGUMENT``, ``TW_ERR_NULL_ARGUMENT``,
    ``TW_ERR_STALE_LEASE``)."""


class QuotaExceeded(Error):
    """A per-peer limit (lease count, leased bytes, ...) would be exceeded
    (``TW_ERR_QUOTA_EXCEEDED``): the consumer holds too much; release tensors or raise
    the limit when opening the connection."""


class ResourceExhausted(Error):
    """The machine or a process limit said no (``TW_ERR_RESOURCE``): no free fd
    (``ulimit -n``), no address space or memory (``ulimit -v``), a file-size limit, a full
    shared-memory file system. The message names the call and the limit; a tensor that
    could not be received this way has had its lease handed back."""


class CudaUnavailable(Error):
    """CUDA tensors cannot travel here (``TW_ERR_CUDA_UNAVAILABLE``): no driver, no
    device, or an extension built without CUDA."""


# Result name -> class, for every code with a class narrower than Error; BASE_CODES are
# the codes that raise the base Error (an I/O error the message names, a CUDA driver error,
# a panic caught at the C ABI). Both come from the library's table (each code's number,
# name, error kind and class); ffi/tests/mirrored_tables.rs checks that every class it names is
# defined above.
CODES: dict[str, type[Error]] = {}
BASE_CODES: tuple[str, ...] = ()
for _code, _name, _kind, _class in _native.result_codes():
    if _class == "Error":
        BASE_CODES += (_name,)
    elif _class:
        CODES[_name] = globals()[_class]
del _code, _name, _kind, _class

_PREFIX = re.compile(r"tensorwire \((TW_[A-Z0-9_]+)\): ")


def translate(exc: RuntimeError) -> Error:
    """The tensorwire exception for a ``RuntimeError`` raised by a ``torch.ops.tensorwire``
    op (returned, not raised; the caller raises it ``from`` the original)."""
    if isinstance(exc, Error):
        return exc
    message = str(exc)
    m = _PREFIX.search(message)
    code = m.group(1) if m else None
    cls = CODES.get(code, Error) if code else Error
    return cls(message, code)


class RemoteError(Error):
    """The function a :mod:`tensorwire.rpc` call ran on the other side raised.
    ``remote_type`` is the exception's type there (``"ValueError"``,
    ``"mypkg.errors.BadInput"``; empty when the peer did not say, as a pyisolate peer does
    not) and ``remote_traceback`` its traceback text, formatted there. The exception's own
    class is never rebuilt here: nothing from the peer is unpickled or imported."""

    def __init__(self, message: str, remote_type: str = "", remote_traceback: str = "") -> None:
        super().__init__(message, None)
        self.remote_type = remote_type
        self.remote_traceback = remote_traceback
