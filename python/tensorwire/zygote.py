"""A zygote for :func:`tensorwire.rpc.spawn` workers (``docs/DESIGN.md``, "The zygote"):
``python -P -m tensorwire.zygote module...`` imports torch, tensorwire and the modules
named (the spec's ``preload``, and the target's module when the worker is not
sandboxed), then forks a worker per request of its supervisor, so a worker starts with
those imports done. It runs trusted code only and serves no calls; it must not start CUDA.
A sandboxed spec's zygote has only the allow-listed environment, and each worker it forks
is contained before its Python runs again (keeper, namespaces, landlock: the request's
``sandbox``), then applies its system-call policy and imports its target as an exec'd
sandboxed worker does.

Its control socket is the fd the supervisor's launch left it (as a worker's connection).
A request is a little-endian ``u32`` length and JSON ``{"argv", "parent", "limits",
"output", "sandbox"}``, sent with the worker's connection (and its stdout and stderr write
ends when ``output``, and the landlock ruleset with a ``sandbox``) by ``SCM_RIGHTS``; the answer is the same framing around ``{"pid": n}`` or
``{"error": why, "pid": n|null}``. The fork (``_native.zygote_fork``) makes the worker a
child of the supervisor, which waits for it as for an exec'd worker. Started any other
way it exits with status 2.
"""
from __future__ import annotations

import gc
import importlib
import json
import os
import socket
import struct
import sys
from typing import Any, Optional

#: The fd variable of a worker's launch, which names the zygote's control socket here.
FD_ENV = "TENSORWIRE_WORKER_FD"
#: The sandbox a worker applies to itself (its system-call policy), as an exec'd one gets it.
SANDBOX_ENV = "TENSORWIRE_WORKER_SANDBOX"
_MAX_REQUEST = 1 << 20
_WORKER_MODULE = ["-m", "tensorwire.worker"]


def _recv_exact(sock: socket.socket, n: int) -> Optional[bytes]:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def _answer(sock: socket.socket, what: dict[str, Any]) -> None:
    body = json.dumps(what).encode()
    sock.sendall(struct.pack("<I", len(body)) + body)


def _worker_args(argv: list[str]) -> list[str]:
    """The worker's own arguments in the spec's ``[-P] -m tensorwire.worker target``."""
    for i in range(len(argv) - 1):
        if argv[i:i + 2] == _WORKER_MODULE:
            return argv[i + 2:]
    raise ValueError(f"the worker's arguments {argv!r} do not run tensorwire.worker; this zygote forks only those")


def _run_worker(args: list[str]) -> int:
    """In the forked worker: what ``python -m tensorwire.worker`` would do."""
    from . import worker

    sys.argv = [worker.__file__, *args]
    return worker.main(sys.argv)


def _serve(ctl: socket.socket) -> int:
    from . import _native

    while True:
        head = _recv_exact_fds(ctl)
        if head is None:
            return 0  # the supervisor closed: nothing more to start
        msg, fds = head
        child_fds: list[int] = list(fds)
        try:
            req = json.loads(msg)
            args = _worker_args([str(a) for a in req["argv"]])
            want_output = bool(req["output"])
            box = req.get("sandbox")
            if len(fds) != 1 + (2 if want_output else 0) + (1 if box else 0):
                raise ValueError(f"a request with output={want_output}, sandbox={bool(box)} came with {len(fds)} fds")
            limits = req["limits"]
            output = (fds[1], fds[2]) if want_output else None
            confine = None
            if box:
                confine = (fds[-1], fds[0], str(box["uid_map"]).encode(), str(box["gid_map"]).encode(), bool(box["namespaces"]),
                           bool(box["own_proc"]))
            pid = _native.zygote_fork(int(req["parent"]), output, limits[0], limits[1], limits[2], confine)
        except OSError as e:
            for fd in child_fds:
                os.close(fd)
            failed = int(e.filename) if isinstance(e.filename, str) and e.filename.isdigit() else None
            _answer(ctl, {"error": f"{type(e).__name__}: {e}", "pid": failed})
            continue
        except Exception as e:  # noqa: BLE001 - a bad request is answered, the zygote stays
            for fd in child_fds:
                os.close(fd)
            _answer(ctl, {"error": f"{type(e).__name__}: {e}", "pid": None})
            continue
        if pid == 0:
            # The worker: nothing of the zygote's control socket, its fds as a launched
            # worker has them.
            code = 1
            try:
                if box:
                    # The set-up closed every fd but 0-2 and the connection already.
                    ctl.detach()
                    os.environ[SANDBOX_ENV] = str(box["policy"])
                else:
                    ctl.close()
                    for fd in child_fds[1:]:
                        os.close(fd)
                os.environ[FD_ENV] = str(child_fds[0])
                code = _run_worker(args)
            except BaseException as e:  # noqa: BLE001 - the worker must never return into the zygote's loop
                print(f"tensorwire.zygote: worker: {type(e).__name__}: {e}", file=sys.stderr)
            finally:
                try:
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(code)
        for fd in child_fds:
            os.close(fd)
        _answer(ctl, {"pid": pid})


def _recv_exact_fds(ctl: socket.socket) -> Optional[tuple[bytes, list[int]]]:
    """One request: its JSON and the fds that came with its first bytes."""
    data, fds, _flags, _addr = socket.recv_fds(ctl, 4, 8)
    if not data:
        return None
    data += _recv_exact(ctl, 4 - len(data)) or b""
    if len(data) < 4:
        return None
    (n,) = struct.unpack("<I", data)
    if n > _MAX_REQUEST:
        raise ValueError(f"a request of {n} bytes (at most {_MAX_REQUEST})")
    body = _recv_exact(ctl, n)
    if body is None:
        return None
    return body, list(fds)


def main(argv: list[str]) -> int:
    text = os.environ.pop(FD_ENV, None)
    if text is None or not text.isdigit():
        print("tensorwire.zygote: started without a control socket (tensorwire starts it for a spec with zygote=True)", file=sys.stderr)
        return 2
    if not getattr(sys.flags, "safe_path", False) and sys.path and sys.path[0] in ("", os.getcwd()):
        del sys.path[0]
    ctl = socket.socket(fileno=int(text))
    os.set_inheritable(ctl.fileno(), False)
    import torch  # noqa: F401 - the import every worker would pay

    from . import _native, rpc  # noqa: F401
    for name in argv[1:]:
        importlib.import_module(name)
    # What is imported now is shared with every fork: kept out of the collector's sweeps,
    # so a worker's collections do not write (copy) the zygote's pages.
    gc.collect()
    gc.freeze()
    return _serve(ctl)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
