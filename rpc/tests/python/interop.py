"""pyisolate 0.10.2 interop peer for tensorwire-rpc's tests, on pyisolate's own
JSONSocketTransport + AsyncRPC (no reimplementation of the protocol here).

    python interop.py client UDS_PATH   # call a Rust server's objects; exit 0 iff all checks pass
    python interop.py server UDS_PATH   # serve object "py" until the Rust peer closes
"""
import asyncio
import os
import socket
import sys

from pyisolate._internal.rpc_protocol import AsyncRPC
from pyisolate._internal.rpc_transports import JSONSocketTransport


class RustEcho:
    """Shape of the Rust service (create_caller wants coroutine functions)."""

    async def echo(self, *args): ...
    async def echo_kw(self, **kwargs): ...
    async def add(self, a, b): ...
    async def fail(self, msg): ...
    async def call_back(self, cb, *args): ...
    async def describe(self, value): ...
    async def make_tensor(self): ...
    async def parent_seen(self): ...


def check(cond, what):
    if not cond:
        print(f"FAIL: {what}", flush=True)
        sys.exit(1)
    print(f"ok: {what}", flush=True)


async def client(path):
    import torch

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    rpc = AsyncRPC(transport=JSONSocketTransport(sock))
    rpc.run()
    rs = rpc.create_caller(RustEcho, "echo")

    check(await rs.add(1, 2) == 3, "add(1, 2) == 3")
    check(await rs.add(1.5, 2) == 3.5, "add(1.5, 2) == 3.5")
    nested = {"a": [1, 2.5, None, True, "é😀"], "b": {"c": [float("inf")]}, "big": 2**70}
    r = await rs.echo(nested, b"\x00\xffbytes", "x")
    check(r[0] == nested, f"nested structure round trip: {r[0]!r}")
    check(r[1] == b"\x00\xffbytes", "bytes round trip as bytes")
    nan = (await rs.echo(float("nan")))[0]
    check(nan != nan, "NaN round trip")
    r = await rs.echo_kw(x=1, y=[b"k"])
    check(r == {"x": 1, "y": [b"k"]}, f"kwargs: {r!r}")
    try:
        await rs.fail("boom from rust")
        check(False, "fail() raised")
    except Exception as e:  # pyisolate raises Exception(error string)
        check(str(e) == "boom from rust", f"error string: {e!r}")

    calls = []

    def mul(a, b):
        calls.append((a, b))
        return a * b

    check(await rs.call_back(mul, 6, 7) == 42 and calls == [(6, 7)], "sync callback invoked by Rust")

    async def nested_cb(x):
        # Called by Rust while Rust's call_back handler waits; calls Rust again.
        return await rs.add(x, 100)

    check(await rs.call_back(nested_cb, 5) == 105, "nested: Rust -> Python callback -> Rust call")
    check(await rs.parent_seen() is None, "top-level call has parent_call_id None")

    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()  # strided view
    d = await rs.describe(t)
    check(d["dtype"] == "torch.float32" and d["shape"] == [4, 3] and d["sum"] == float(t.sum()), f"torch TensorRef decoded by Rust: {d}")
    d = await rs.describe(torch.tensor([1, 2, 3], dtype=torch.int64))
    check(d["sum"] == 6 and d["dtype"] == "torch.int64", f"int64 tensor: {d}")
    m = await rs.make_tensor()
    check(isinstance(m, torch.Tensor), f"Rust tensor rebuilt by torch: {type(m)}")
    check(m.dtype == torch.float32 and list(m.shape) == [2, 3] and m.tolist() == [[1, 2, 3], [4, 5, 6]], f"values {m}")
    back = (await rs.echo(t))[0]
    check(torch.equal(back, t), "tensor echoed through Rust")

    rpc.shutdown()
    print("client: all checks passed", flush=True)


class Py:
    def __init__(self, rpc):
        self.rpc = rpc

    async def add(self, a, b):
        return a + b

    async def echo(self, *args, **kwargs):
        return [list(args), kwargs]

    async def fail(self, msg):
        raise ValueError(msg)

    async def call_back(self, cb, *args):
        return await cb(*args)

    async def nested(self, x):
        rs = self.rpc.create_caller(RustEcho, "rs")
        return await rs.add(x, 1000)

    def sync_method(self, x):
        return x * 2

    async def make_tensor(self):
        import torch

        return torch.arange(6, dtype=torch.float64).reshape(2, 3)

    async def describe(self, t):
        import torch

        return {"dtype": str(t.dtype), "shape": list(t.shape), "sum": float(t.sum()), "is_tensor": isinstance(t, torch.Tensor)}


async def server(path):
    import torch  # noqa: F401  (pyisolate imports it lazily; load it before serving)

    lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lsock.bind(path + ".tmp")
    lsock.listen(1)
    os.rename(path + ".tmp", path)  # appears only once listening
    conn, _ = await asyncio.get_running_loop().run_in_executor(None, lsock.accept)
    rpc = AsyncRPC(transport=JSONSocketTransport(conn))
    rpc.register_callee(Py(rpc), "py")
    rpc.run()
    await rpc.run_until_stopped()
    rpc.shutdown()


if __name__ == "__main__":
    mode, path = sys.argv[1], sys.argv[2]
    asyncio.run(client(path) if mode == "client" else server(path))
