"""Lease counters as a user reads them: ``live_bytes`` is the memory the peer's leases keep
alive, each storage once however many views of it were sent (the Rust test
tests/cross_process.rs::live_bytes_count_each_storage_once does the same across
processes)."""

import time

import pytest

import tensorwire
from support import connected_pair

MIB = 1 << 20



def test_two_views_of_one_storage_count_once():
    a, b = connected_pair(max_lease_bytes=64 * MIB)
    with a, b:
        t = tensorwire.zeros(4096, 4096)  # 64 MiB
        a.send(t)
        a.send(t.t())  # another view of the same storage: no more memory held
        u, v = b.recv(timeout=5), b.recv(timeout=5)
        s = a.stats()
        assert (s["live_leases"], s["live_bytes"]) == (2, 64 * MIB), s
        with pytest.raises(tensorwire.QuotaExceeded, match="67108864-byte limit"):
            a.send(tensorwire.zeros(1024))  # another storage passes the 64 MiB quota
        del u  # one view released: the storage is still held by the other
        deadline = time.monotonic() + 10
        while a.stats()["live_leases"] != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (a.stats()["live_leases"], a.stats()["live_bytes"]) == (1, 64 * MIB), a.stats()
        del v
        while a.stats()["live_leases"] != 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (a.stats()["live_leases"], a.stats()["live_bytes"]) == (0, 0), a.stats()
