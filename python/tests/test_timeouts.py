"""Time-outs a user can reason about: the default handshake bound covers a child's own
start-up (``import torch``) with margin; every time in the Python API is in seconds, the
older millisecond names warn and still work."""

import os
import subprocess
import sys
import time
import warnings

import pytest
import torch

import tensorwire
import support
from support import connected_pair
from tensorwire.connection import HANDSHAKE_TIMEOUT_S

# The child imports tensorwire (and so torch: seconds on a busy machine), then waits
# more, before it says hello: all of it is charged to the parent's handshake.
_SLOW_CHILD = r'''
import sys, time
import tensorwire
time.sleep(float(sys.argv[2]))
with tensorwire.from_fd(int(sys.argv[1])) as c:
    t = c.recv(timeout=30)
    print("GOT", float(t.sum()), flush=True)
'''


def test_default_handshake_covers_a_slow_child_start():
    # Import plus 10.5 s: past the Rust/C default of 10 s, which Python used before.
    parent_fd, child_fd = tensorwire.socketpair()
    child = subprocess.Popen([sys.executable, "-c", _SLOW_CHILD, str(child_fd), "10.5"],
                             pass_fds=[child_fd], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    os.close(child_fd)
    try:
        with tensorwire.from_fd(parent_fd) as conn:
            conn.send(torch.ones(8))
            out, err = child.communicate(timeout=60)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == 0, err
    assert "GOT 8.0" in out
    assert HANDSHAKE_TIMEOUT_S >= 60


def test_handshake_timeout_is_in_seconds():
    a, b = tensorwire.socketpair(inheritable_child=False)
    try:
        start = time.monotonic()
        with pytest.raises(tensorwire.Timeout, match="hello") as e:
            tensorwire.from_fd(a, handshake_timeout=0.3)  # the peer never answers
        took = time.monotonic() - start
        assert e.value.code == "TW_ERR_TIMEOUT"
        assert 0.25 < took < 5, took
    finally:
        os.close(b)


def test_a_peer_that_closed_its_end_ends_the_handshake_at_once():
    a, b = tensorwire.socketpair(inheritable_child=False)
    os.close(b)
    start = time.monotonic()
    with pytest.raises(tensorwire.PeerGone):
        tensorwire.from_fd(a, handshake_timeout=None)  # no limit: the peer's end ends it
    assert time.monotonic() - start < 5



def _wait_expired(conn, n, within=10.0):
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if conn.stats()["expired"] >= n:
            return True
        time.sleep(0.02)
    return False


def test_window_is_in_seconds():
    a, b = connected_pair()
    with a, b:
        a.send(tensorwire.zeros(16), window=0.2)
        held = b.recv(timeout=5)  # held past the window: the lease expires
        assert _wait_expired(a, 1), a.stats()
        a.send(tensorwire.zeros(16), window=2)  # 2 s, not 2 ms: still held half a second later
        held2 = b.recv(timeout=5)
        time.sleep(0.5)
        assert a.stats()["expired"] == 1 and a.stats()["live_leases"] == 1, a.stats()
        del held, held2


def test_connection_window_is_in_seconds():
    a, b = connected_pair(window=0.2)
    with a, b:
        a.send(tensorwire.zeros(16))
        held = b.recv(timeout=5)
        assert _wait_expired(a, 1), a.stats()
        del held


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), "1"])
def test_times_in_seconds_are_checked(bad):
    a, b = connected_pair()
    with a, b:
        with pytest.raises(ValueError, match="window must be a (positive|finite) number of seconds"):
            a.send(tensorwire.zeros(4), window=bad)
    for name in ("window", "handshake_timeout", "cuda_wait_timeout"):
        x, y = tensorwire.socketpair(inheritable_child=False)
        try:
            with pytest.raises(ValueError, match=f"{name} must be a"):
                tensorwire.from_fd(x, **{name: bad})
        finally:
            os.close(x)
            os.close(y)


def _one_deprecation(record, old, new, caller=__file__):
    hits = [w for w in record if issubclass(w.category, DeprecationWarning) and old in str(w.message)]
    assert len(hits) == 1, [str(w.message) for w in record]
    assert f"pass {new}= in seconds" in str(hits[0].message)
    assert hits[0].filename == caller  # points at the caller, not at tensorwire
    return hits[0]


def test_millisecond_names_are_deprecated_aliases():
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        a, b = connected_pair(handshake_timeout_ms=5000, window_ms=200)
    # The helper made the call: the warnings point at it.
    _one_deprecation(record, "handshake_timeout_ms", "handshake_timeout", caller=support.__file__)
    _one_deprecation(record, "window_ms", "window", caller=support.__file__)
    with a, b:
        a.send(tensorwire.zeros(16))  # the connection's window: 200 ms, as before
        held = [b.recv(timeout=5)]  # each kept past its window: its lease expires
        assert _wait_expired(a, 1), a.stats()
        for call in (lambda: a.send(tensorwire.zeros(16), 0, 200),            # positional, as before
                     lambda: a.send(tensorwire.zeros(16), window_ms=200),
                     lambda: tensorwire.send(a, tensorwire.zeros(16), window_ms=200)):
            with warnings.catch_warnings(record=True) as record:
                warnings.simplefilter("always")
                call()
            _one_deprecation(record, "window_ms", "window")
            held.append(b.recv(timeout=5))
        assert _wait_expired(a, 4), a.stats()  # each still meant 200 ms
        del held
        with pytest.raises(TypeError, match="not both"):
            a.send(tensorwire.zeros(4), window_ms=1, window=1.0)
    x, y = tensorwire.socketpair(inheritable_child=False)
    try:
        with pytest.raises(TypeError, match="not both"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tensorwire.from_fd(x, handshake_timeout=1.0, handshake_timeout_ms=1000)
    finally:
        os.close(x)
        os.close(y)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        a, b = connected_pair(cuda_wait_timeout_ms=1500)
    a.close(), b.close()
    _one_deprecation(record, "cuda_wait_timeout_ms", "cuda_wait_timeout", caller=support.__file__)
