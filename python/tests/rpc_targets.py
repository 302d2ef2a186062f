"""Objects the workers of test_rpc.py serve (``python -m tensorwire.worker
rpc_targets:<name>``): imported in the worker process, never in the test's."""
from __future__ import annotations

import os
import resource
import select
import socket
import struct
import threading
import time

import torch

import tensorwire.rpc as rpc


class Plugin:
    def add(self, a, b):
        return a + b

    def echo(self, x):
        return x

    def echo_kw(self, **kw):
        return kw

    def same_floats(self, floats, hexes):
        """Whether each float arrived as the double whose bytes (little-endian hex) came
        beside it."""
        import struct
        return [struct.pack("<d", f).hex() for f in floats] == hexes

    def keys(self, d):
        """The dict's keys in the order this process sees them."""
        return list(d)

    def shared_keys(self, records):
        """For each key of the first record: whether every record holds that same str
        object (one made per distinct key, as json.loads makes them)."""
        first = list(records[0])
        return [all(list(r)[i] is k for r in records) for i, k in enumerate(first)]

    def describe(self, t):
        return {"dtype": str(t.dtype), "shape": list(t.shape), "stride": list(t.stride()), "sum": float(t.sum())}

    def layout_and_bytes(self, t):
        """What arrived, exactly: dtype, shape, strides, and the elements' bytes in order."""
        packed = t.contiguous().reshape(-1).view(torch.uint8)
        return {"dtype": str(t.dtype), "shape": list(t.shape), "stride": list(t.stride()), "bytes": packed.tolist()}

    def scale(self, t, k=2.0):
        return t * k

    def fill(self, n, value):
        t = rpc.empty(n)
        t.fill_(value)
        return t

    def fail(self, message):
        raise KeyError(message)

    def sleep(self, seconds):
        time.sleep(seconds)
        return seconds

    def hold(self, t, seconds):
        time.sleep(seconds)
        return float(t.sum())

    def pid(self):
        return os.getpid()

    def exit(self, status):
        os._exit(status)

    def ask_host(self, x):
        return rpc.host().call("host", "double", x)

    # A gate a call waits at until a later call opens it (the worker must keep reading
    # requests while one handler blocks).
    _gate = threading.Event()
    _at_gate = threading.Event()

    def wait_at_gate(self, seconds):
        self._at_gate.set()
        try:
            return "opened" if self._gate.wait(seconds) else "never opened"
        finally:
            self._gate.clear()
            self._at_gate.clear()

    def at_gate(self):
        return self._at_gate.is_set()

    def open_gate(self):
        self._gate.set()

    def say(self, text):
        print(text, flush=True)

    def nofile(self):
        return resource.getrlimit(resource.RLIMIT_NOFILE)[0]

    def try_open(self, path):
        try:
            with open(path, "rb") as f:
                f.read(1)
            return "opened"
        except OSError as e:
            return f"{type(e).__name__}: errno {e.errno}"

    def try_inet(self):
        try:
            socket.socket(socket.AF_INET, socket.SOCK_STREAM).close()
            return "opened"
        except OSError as e:
            return f"{type(e).__name__}: errno {e.errno}"

    def try_exec(self):
        try:
            os.execv("/bin/true", ["/bin/true"])
        except OSError as e:
            return f"{type(e).__name__}: errno {e.errno}"

    def hostile(self, kind):
        """Write bytes the protocol does not allow on the connection to the host, then
        wait to be killed."""
        fd = int(os.environ["TENSORWIRE_WORKER_FD"])
        if kind == "length":
            frame = b"\xff\xff\xff\xff"
        elif kind == "deep":
            body = b"[" * 1_000_000
            frame = struct.pack(">I", len(body)) + body
        elif kind == "deep_result":
            # Inside a response's result, which the host checks without building it.
            body = b'{"kind": "response", "call_id": 0, "result": ' + b"[" * 1_000_000
            frame = struct.pack(">I", len(body)) + body
        elif kind == "bad_result":
            body = b'{"kind": "response", "call_id": 0, "result": {"a": [1, 2,]}, "error": null}'
            frame = struct.pack(">I", len(body)) + body
        else:
            body = b"\x00\x01garbage, not JSON"
            frame = struct.pack(">I", len(body)) + body
        view = memoryview(frame)
        while view:
            try:
                view = view[os.write(fd, view):]
            except BlockingIOError:  # the connection's socket is non-blocking
                select.select([], [fd], [], 1.0)
        time.sleep(60)


class SlowImport:
    """Stands for a plugin whose imports outlast the handshake time-out."""

    def __init__(self):
        time.sleep(30)


functions_only = Plugin()


PYISOLATE_PEER = r"""
import asyncio, socket, sys
from pyisolate._internal.rpc_protocol import AsyncRPC
from pyisolate._internal.rpc_transports import JSONSocketTransport

class Calc:
    async def add(self, a, b):
        return a + b
    async def total(self, t):
        return float(t.sum())
    async def fail(self, message):
        raise ValueError(message)

async def main(fd):
    rpc = AsyncRPC(transport=JSONSocketTransport(socket.socket(fileno=fd)))
    rpc.register_callee(Calc(), "calc")
    rpc.run()
    await rpc.run_until_stopped()

asyncio.run(main(int(sys.argv[1])))
"""
