"""pyisolate's own round trip: AsyncRPC client <-> AsyncRPC server over
JSONSocketTransport on a Unix socket (two processes), calling add(1, 2).

    python pyisolate_rtt.py [N]      # prints one JSON line: p50_us, p90_us, mean_us,
                                     # calls_per_s, lat_us (every sample, µs)
"""
import asyncio
import json
import os
import socket
import statistics
import sys
import tempfile
import time

from pyisolate._internal.rpc_protocol import AsyncRPC
from pyisolate._internal.rpc_transports import JSONSocketTransport


class Calc:
    async def add(self, a, b):
        return a + b


async def serve(conn):
    rpc = AsyncRPC(transport=JSONSocketTransport(conn))
    rpc.register_callee(Calc(), "calc")
    rpc.run()
    await rpc.run_until_stopped()
    rpc.shutdown()


async def client(path, n):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    rpc = AsyncRPC(transport=JSONSocketTransport(sock))
    rpc.run()
    calc = rpc.create_caller(Calc, "calc")
    for _ in range(200):
        await calc.add(1, 2)
    lat = []
    t0 = time.perf_counter()
    for _ in range(n):
        s = time.perf_counter()
        r = await calc.add(1, 2)
        lat.append(time.perf_counter() - s)
    total = time.perf_counter() - t0
    assert r == 3
    rpc.shutdown()
    lat_us = [x * 1e6 for x in lat]
    return {
        "p50_us": statistics.median(lat_us),
        "p90_us": sorted(lat_us)[int((n - 1) * 0.9)],
        "mean_us": statistics.fmean(lat_us),
        "lat_us": [round(x, 3) for x in lat_us],
        "calls_per_s": n / total,
        "n": n,
    }


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    path = os.path.join(tempfile.mkdtemp(), "pyisolate-bench.sock")
    lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lsock.bind(path)
    lsock.listen(1)
    pid = os.fork()
    if pid == 0:
        conn, _ = lsock.accept()
        asyncio.run(serve(conn))
        os._exit(0)
    res = asyncio.run(client(path, n))
    os.waitpid(pid, 0)
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
