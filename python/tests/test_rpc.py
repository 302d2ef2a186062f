"""tensorwire.rpc across real processes: a Python host spawns Python workers
(``python -m tensorwire.worker rpc_targets:...``) and calls them — values and tensors,
remote exceptions, callbacks into the host, many calls in flight and asyncio, per-call
deadlines, crashes, the warm pool, limits, the sandbox, a hostile worker, a handshake
that never comes."""
from __future__ import annotations

import asyncio
import ctypes
import gc
import math
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

import tensorwire
import tensorwire.rpc as rpc
from support import gone, wait_for

HERE = str(Path(__file__).resolve().parent)
sys.path.insert(0, HERE)  # rpc_targets, for the pyisolate peer's script
ENV = {"PYTHONPATH": HERE}


def spawn(target: str = "rpc_targets:Plugin", **kw):
    kw.setdefault("timeout", 60.0)  # no call in these tests may hang the run
    return rpc.spawn(target, env=ENV, **kw)


@pytest.fixture(scope="module")
def worker():
    with spawn(output="capture") as w:
        yield w


# ---- values ----------------------------------------------------------------------------

def test_json_values_round_trip(worker):
    assert worker.call("add", 1, 2) == 3
    assert worker.call("add", a=2**70, b=1) == 2**70 + 1
    value = {"list": [1, 2.5, None, True, "x"], "nested": {"deep": [[[]]]}, "tuple": (1, 2), "nan": float("inf")}
    back = worker.call("echo", value)
    assert back == {**value, "tuple": [1, 2]}  # a tuple arrives as a list (JSON)
    assert worker.call("echo", "ünïcode ✓") == "ünïcode ✓"


def test_values_arrive_as_they_were_sent_both_ways(worker):
    # Written straight from the objects to the wire's text and read straight back (no
    # tree between): every kind of JSON value, in the forms that are easy to get wrong.
    value = {
        "ints": [0, -1, 2**63 - 1, -2**63, 2**63, -2**64 - 5, 10**80, True, False],
        "floats": [0.0, -0.0, 1.0, 0.1, -2.5e-300, 1e300, 5e-324, 1e16, 123456.789, 1 / 3],
        "strs": ["", "plain", 'q"uote', "back\\slash", "tab\tnl\ncr\r", "\x00\x01\x1f\x7f", "é ✓ 😀 \u2028", "/"],
        "nested": {"a": [[], {}, [[{"b": None}]]], "t": (1, (2, 3))},
        "ünï ✓": {"ké ✓": 1, "k" * 64: 2},
    }
    want = {**value, "nested": {"a": [[], {}, [[{"b": None}]]], "t": [1, [2, 3]]}}
    back = worker.call("echo", value)
    assert back == want
    assert [type(x) for x in back["ints"]] == [int] * 7 + [bool] * 2
    assert [type(x) for x in back["floats"]] == [float] * 10
    assert str(back["floats"][1]) == "-0.0"
    special = worker.call("echo", [float("inf"), float("-inf"), float("nan")])
    assert special[:2] == [float("inf"), float("-inf")] and special[2] != special[2]
    # Keyword arguments: the same both ways.
    assert worker.call("echo_kw", x=value) == {"x": want}
    # A key written with an escape (read through the tree, as one could spell "__type__").
    assert worker.call("echo", {"\n key\"": [2**70, -0.0], "__typ": 1}) == {"\n key\"": [2**70, -0.0], "__typ": 1}
    deep = []
    for _ in range(200):
        deep = [deep]
    assert worker.call("echo", deep) == deep
    # A tensor inside: the value travels as before, tagged, the rest as it was.
    t = torch.arange(6.0)
    back = worker.call("echo", {"t": t, "rest": value["strs"]})
    assert torch.equal(back["t"], t) and back["rest"] == value["strs"]


def test_floats_arrive_bit_for_bit_both_ways(worker):
    # Written with their shortest digits and read back: every float (random bit
    # patterns, the decimal range's edges, subnormals, two shortest forms equally near)
    # is the same double at the worker and back here.
    import random
    import struct
    rng = random.Random(7)
    floats = [struct.unpack("<d", struct.pack("<Q", rng.getrandbits(64)))[0] for _ in range(3000)]
    floats += [rng.random() * 10.0 ** rng.randint(-6, 18) for _ in range(3000)]
    floats += [1e-4, 9.999999999999999e-05, 1e16, 9999999999999998.0, 947482943091749.2, 5e-324, 2.2250738585072014e-308,
               1.7976931348623157e308, 1e308, -0.0, 0.1 + 0.2, 1 / 7, 2.0 ** 53 + 2]
    floats = [f for f in floats if math.isfinite(f)]
    bits = lambda xs: [struct.pack("<d", x) for x in xs]
    assert bits(worker.call("echo", floats)) == bits(floats)
    assert worker.call("same_floats", floats, [struct.pack("<d", f).hex() for f in floats]) is True


def test_subclasses_travel_as_their_json_kind_and_depth_counts_leaves(worker):
    # Exact types take the writer's direct path; a subclass (an IntEnum, an OrderedDict,
    # a str or list subclass) takes the checked one and arrives as the plain value.
    import collections
    import enum

    class Color(enum.IntEnum):
        RED = 7

    class S(str):
        pass

    class L(list):
        pass

    class F(float):
        pass

    value = collections.OrderedDict([("e", Color.RED), ("s", S("text")), ("l", L([1, (2, F(0.5))])), ("b", [True, None])])
    back = worker.call("echo", value)
    assert back == {"e": 7, "s": "text", "l": [1, [2, 0.5]], "b": [True, None]}
    assert [type(back[k]) for k in ("e", "s", "l")] == [int, str, list] and type(back["b"][0]) is bool
    # The depth limit counts the leaf as a level: an int inside 257 lists is refused
    # before sending, as a list inside them is.
    for leaf in (1, "s", 0.5, []):
        nested = leaf
        for _ in range(257):
            nested = [nested]
        with pytest.raises(tensorwire.Refused, match="nested deeper"):
            worker.call("echo", nested)
    assert worker.call("add", 1, 1) == 2


def test_bench_sized_values_round_trip(worker):
    from tensorwire.bench_rpc import json_payload
    records = json_payload()
    assert worker.call("echo", records) == records
    table = {f"key{i}": [i, i * 0.5, f"s{i}"] for i in range(333)}
    assert worker.call("echo", table) == table
    assert worker.call("keys", table) == list(table)


def test_a_dict_keeps_its_key_order_both_ways(worker):
    # Not sorted, not reverse-sorted: an order only insertion can explain.
    order = ["zeta", "alpha", "mid", "10", "2", "Beta", "_"]
    inner = {k: i for i, k in enumerate(reversed(order))}
    value = {k: (inner if k == "mid" else i) for i, k in enumerate(order)}
    value["t"] = rpc.empty(4).fill_(1)  # a tensor among the values, replaced in place
    assert worker.call("keys", value) == order + ["t"]
    back = worker.call("echo", value)
    assert list(back) == order + ["t"]
    assert list(back["mid"]) == list(reversed(order))
    assert back["t"].tolist() == [1.0] * 4
    # A later duplicate key cannot arise from a dict; the JSON parser's rule for one (the
    # last value, in the first one's place, as json.loads) is tested in Rust.


def test_records_arrive_sharing_one_str_per_key(worker):
    # As json.loads gives them: one str per distinct key, shared by every record (memory,
    # and each key hashed once); a key of 64 bytes or more is made each time.
    long = "k" * 64
    records = [{"id": i, "name": f"n{i}", long: i} for i in range(50)]
    assert worker.call("shared_keys", records) == [True, True, False]


def test_values_that_are_not_json_are_refused_before_sending(worker):
    with pytest.raises(tensorwire.Refused, match="cannot send a set"):
        worker.call("echo", {1, 2})
    with pytest.raises(tensorwire.Refused, match="dict keys must be str"):
        worker.call("echo", {1: "a"})
    cyclic: list = []
    cyclic.append(cyclic)
    with pytest.raises(tensorwire.Refused, match="nested deeper"):
        worker.call("echo", cyclic)
    assert worker.call("add", 1, 1) == 2  # the worker was never involved


def test_tensors_that_cannot_travel_are_refused_before_sending(worker):
    with pytest.raises(tensorwire.Refused, match="a meta tensor cannot be sent"):
        worker.call("echo", torch.empty(4, device="meta"))
    with pytest.raises(tensorwire.Refused, match="only strided"):
        worker.call("echo", torch.eye(3).to_sparse())
    if hasattr(torch, "float8_e4m3fn"):  # a dtype the binding maps by its own table too
        t = worker.call("echo", torch.ones(3, dtype=torch.float8_e4m3fn))
        assert t.dtype == torch.float8_e4m3fn and t.float().tolist() == [1.0, 1.0, 1.0]
    assert worker.call("add", 1, 1) == 2


def test_tensors_travel_both_ways(worker):
    x = torch.arange(12, dtype=torch.float64).reshape(3, 4)
    d = worker.call("describe", x.t())  # a non-contiguous view of private memory: copied packed
    assert d == {"dtype": "torch.float64", "shape": [4, 3], "stride": [3, 1], "sum": 66.0}
    y = worker.call("scale", x, k=0.5)
    assert torch.equal(y, x * 0.5)
    shared = rpc.empty(1000, dtype=torch.int32)
    shared.copy_(torch.arange(1000, dtype=torch.int32))
    assert worker.call("describe", shared[10:20])["sum"] == float(sum(range(10, 20)))
    view = shared.view(10, 100).t()[5:7]  # a view of a shared segment: sent as it is
    assert worker.call("describe", view) == {"dtype": "torch.int32", "shape": [2, 10], "stride": [1, 100], "sum": float(view.sum())}
    filled = worker.call("fill", 4096, 7.0)  # made in the worker's shared memory, mapped here
    assert filled.shape == (4096,) and bool((filled == 7.0).all())
    assert worker.call("describe", torch.empty(0, 3))["shape"] == [0, 3]


# Every dtype the package sends: those torch reads from DLPack arrive as one typed view,
# the others (wider unsigned integers, float8) as bytes viewed by torch. Both must give
# the sender's view exactly: dtype, shape, strides, offset and bytes.
RECEIVED_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
                   torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool,
                   torch.uint16, torch.uint32, torch.float8_e4m3fn, torch.float8_e5m2]


def _bytes_of(t):
    return t.contiguous().reshape(-1).view(torch.uint8).tolist()


@pytest.mark.parametrize("dtype", RECEIVED_DTYPES, ids=str)
def test_a_received_view_has_the_senders_dtype_strides_and_bytes(worker, dtype):
    base = rpc.empty(3 * 4 * 5, dtype=dtype)
    base.copy_((torch.arange(60) % 7).to(dtype))
    # Strided, not contiguous, and offset by 22 elements: not a multiple of the fill's
    # period, so a view read from the wrong first element has other bytes.
    view = base.view(3, 4, 5).transpose(0, 2)[2:, :, 1:]
    got = worker.call("layout_and_bytes", view)  # the worker receives the view zero-copy
    assert got == {"dtype": str(dtype), "shape": list(view.shape), "stride": list(view.stride()), "bytes": _bytes_of(view)}
    back = worker.call("echo", view)  # and sends it back: our own memory, no copy either way
    assert back.dtype == dtype and back.shape == view.shape and _bytes_of(back) == _bytes_of(view)
    assert back.data_ptr() == view.data_ptr() and back.stride() == view.stride()
    whole = worker.call("echo", base[9:])  # contiguous with an offset
    assert whole.dtype == dtype and _bytes_of(whole) == _bytes_of(base[9:])
    scalar = base[13]  # no dimensions: DLPack's ndim 0
    assert worker.call("layout_and_bytes", scalar) == {"dtype": str(dtype), "shape": [], "stride": [], "bytes": _bytes_of(scalar)}


def test_a_remote_exception_is_a_remote_error_with_type_and_traceback(worker):
    with pytest.raises(rpc.RemoteError) as info:
        worker.call("fail", "no such plugin")
    e = info.value
    assert isinstance(e, tensorwire.Error)
    assert e.remote_type == "KeyError"
    assert "no such plugin" in str(e)
    assert "Traceback (most recent call last)" in e.remote_traceback and "rpc_targets.py" in e.remote_traceback
    with pytest.raises(rpc.RemoteError, match="no_such_method|not found|NotFound"):
        worker.call("no_such_method")
    assert worker.is_clean()


def test_a_worker_calls_back_into_its_host():
    class Host:
        def double(self, x):
            return 2 * x

    with spawn(serve={"host": Host()}) as w:
        assert w.call("ask_host", 21) == 42
    with pytest.raises(RuntimeError, match="not a serving tensorwire worker"):
        rpc.host()


def test_a_handler_that_blocks_leaves_the_worker_reading_and_calling_back():
    # A lone request's handler runs on the worker's reader thread (no hand-off to a
    # handler thread); while it blocks, a standby reads the next requests: a call that
    # asks the host (which serves it while this test's other call waits), and the call
    # that releases the first.
    class Host:
        def double(self, x):
            return 2 * x

    with spawn(serve={"host": Host()}) as w:
        got = []
        held = threading.Thread(target=lambda: got.append(w.call("wait_at_gate", 30.0)))
        held.start()
        wait_for("the first call to reach its gate", lambda: w.call("at_gate"))
        assert w.call("ask_host", 21, timeout=10.0) == 42
        w.call("open_gate", timeout=10.0)
        held.join(30)
        assert got == ["opened"]
        for i in range(50):  # and the reader thread serves on
            assert w.call("ask_host", i, timeout=10.0) == 2 * i
        assert w.is_clean()


def test_many_calls_in_flight_from_threads_and_asyncio(worker):
    results: dict[int, int] = {}

    def caller(i: int) -> None:
        results[i] = worker.call("add", i, 1000)

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == {i: i + 1000 for i in range(16)}

    async def gather():
        slow = worker.acall("sleep", 0.3)
        fast = [worker.acall("add", i, i) for i in range(8)]
        return await asyncio.gather(slow, *fast)

    t0 = time.monotonic()
    assert asyncio.run(gather()) == [0.3] + [2 * i for i in range(8)]
    assert time.monotonic() - t0 < 10


def test_started_calls_are_waited_for_later():
    class S:
        def add(self, a, b):
            return a + b

    a, b = rpc.pair(None, {"s": S()})
    pending = [a.start("s", "add", i, i) for i in range(10)]
    assert [p.result(timeout=10) for p in pending] == [2 * i for i in range(10)]
    with pytest.raises(tensorwire.Refused, match="already taken"):
        pending[0].result()
    a.close()
    b.close()


def test_a_pyisolate_peer_on_the_other_side_still_works():
    pytest.importorskip("pyisolate", reason="pyisolate is not installed: SKIPPED (scripts/setup-venv.sh installs it)")
    import socket
    import subprocess
    import sys

    from rpc_targets import PYISOLATE_PEER
    from tensorwire import _native

    ours, theirs = socket.socketpair()
    child = subprocess.Popen([sys.executable, "-c", PYISOLATE_PEER, str(theirs.fileno())], pass_fds=[theirs.fileno()])
    theirs.close()
    try:
        ep = rpc.Endpoint(_native.Endpoint.from_fd(ours.detach()))
        assert ep.call("calc", "add", 1, 2, timeout=60) == 3
        assert not ep.native  # a pyisolate peer: tensors go as file_system references
        assert ep.call("calc", "total", torch.ones(256), timeout=60) == 256.0
        with pytest.raises(rpc.RemoteError, match="bad value") as info:
            ep.call("calc", "fail", "bad value", timeout=60)
        assert info.value.remote_type == ""  # pyisolate sends str(exc) only
        ep.close()
    finally:
        child.kill()
        child.wait(30)


def _rust_worker() -> str:
    """The Rust worker example (rpc/examples/worker.rs), built by cargo if it is not."""
    root = Path(HERE).parents[1]
    exe = root / "target" / "debug" / "examples" / "worker"
    import subprocess
    subprocess.run(["cargo", "build", "--locked", "-q", "-p", "tensorwire-rpc", "--example", "worker"], cwd=root, check=True, timeout=900)
    return str(exe)


def test_a_python_host_runs_a_rust_worker():
    with rpc.spawn(command=[_rust_worker()], timeout=60.0) as w:
        assert w.call("add", 2, 40) == 42
        assert w.call("pid") == w.pid
        assert w.call("sum", rpc.empty(1000).fill_(0.5)) == 500.0  # a shared segment, natively
        with pytest.raises(rpc.RemoteError, match="OverflowError") as info:
            w.call("add", 2**62, 2**62)
        assert info.value.remote_type == ""  # a Rust error string carries no Python type
    with pytest.raises(ValueError, match="not both"):
        rpc.spawn("rpc_targets:Plugin", command=["x"])


# ---- supervision ---------------------------------------------------------------------------

def test_a_call_past_its_deadline_kills_the_worker_and_the_next_call_gets_a_fresh_one():
    with spawn() as w:
        first = w.pid
        t0 = time.monotonic()
        with pytest.raises(tensorwire.Timeout, match="killed at its deadline"):
            w.call("sleep", 30, timeout=0.3)
        assert time.monotonic() - t0 < 10
        wait_for("the worker to be gone", lambda: gone(first))
        assert w.state.startswith("down:") and "deadline" in w.state
        assert w.call("add", 2, 2) == 4
        assert w.pid not in (None, first)


def test_a_crash_fails_the_call_in_flight_with_how_the_worker_ended():
    with spawn() as w:
        pid = w.pid
        with pytest.raises(tensorwire.PeerGone, match=f"worker {pid} exited with status 3"):
            w.call("exit", 3)
        pid = w.call("pid")
        killer = threading.Timer(0.3, os.kill, (pid, signal.SIGKILL))
        killer.start()
        with pytest.raises(tensorwire.PeerGone, match=f"worker {pid} was killed by SIGKILL"):
            w.call("sleep", 30)
        killer.join()
        assert w.call("add", 1, 1) == 2  # a fresh worker


def test_tensors_sent_to_a_worker_that_dies_are_released():
    # The worker holds our segment (under a lease) when it is killed: the lease ends with
    # it, and the segment is unmapped once our own last view is gone too.
    from tensorwire import _native
    gc.collect()
    before = _native.live_segments()
    with spawn() as w:
        t = rpc.empty(1 << 20)
        pid = w.call("pid")
        killer = threading.Timer(0.3, os.kill, (pid, signal.SIGKILL))
        killer.start()
        with pytest.raises(tensorwire.PeerGone, match="SIGKILL"):
            w.call("hold", t, 30)
        killer.join()
        assert w.call("describe", t)["sum"] == 0.0  # a fresh worker maps it again
        del t
    gc.collect()
    wait_for("our segments to be unmapped", lambda: _native.live_segments() == before)


def _open_fds_and_threads() -> tuple[int, int]:
    return len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))


def _settled() -> tuple[int, int]:
    """The counts once they held still for half a second: a closed worker's reader and
    output threads end (and close their fds) just after the close returns."""
    last, since = _open_fds_and_threads(), time.monotonic()
    while time.monotonic() - since < 0.5:
        time.sleep(0.02)
        now = _open_fds_and_threads()
        if now != last:
            last, since = now, time.monotonic()
    return last


def test_workers_that_crash_or_time_out_leave_no_fds_or_threads_behind():
    spawn(output="capture").close()  # the spawner thread, once
    before = _settled()
    with spawn(output="capture") as w:
        with pytest.raises(tensorwire.Timeout):
            w.call("sleep", 30, timeout=0.2)
        with pytest.raises(tensorwire.PeerGone):
            w.call("exit", 1)
        assert w.call("add", 1, 1) == 2
    by = time.monotonic() + 10
    while _open_fds_and_threads() != before:
        assert time.monotonic() < by, f"(fds, threads) {_open_fds_and_threads()} after, {before} before"
        time.sleep(0.02)


def test_output_is_captured_or_forwarded_with_a_prefix(worker, capfd):
    worker.call("say", "a captured line")
    wait_for("the captured line", lambda: b"a captured line" in worker.output()[0])
    with spawn(prefix="[plugin] ") as w:
        w.call("say", "a forwarded line")
        wait_for("the forwarded line", lambda: "[plugin] a forwarded line" in capfd.readouterr().out, within=10)


def test_a_handshake_that_never_comes_is_a_timeout_and_the_child_is_killed():
    t0 = time.monotonic()
    with pytest.raises(tensorwire.Timeout, match="handshake"):
        spawn("rpc_targets:SlowImport", handshake_timeout=1.0)
    assert time.monotonic() - t0 < 20
    with pytest.raises(ValueError, match="module:attribute"):
        rpc.spawn("rpc_targets")
    with pytest.raises(tensorwire.PeerGone, match="before its handshake"):
        spawn("no_such_module_anywhere:X", output="capture")


def test_limits_are_set_in_the_worker():
    with spawn(limits=rpc.Limits(open_files=200)) as w:
        assert w.call("nofile") == 200


def test_a_pool_hands_out_warm_workers_and_reuses_only_clean_ones():
    with rpc.WorkerPool("rpc_targets:Plugin", 2, env=ENV, timeout=60.0) as pool:
        assert pool.wait_idle(2, 60)
        w = pool.get()  # warm: already started and past its handshake
        assert pool.idle == 1
        first = w.pid
        assert w.call("add", 1, 2) == 3
        w.release()
        with pool.get() as again:
            assert again.pid == first  # clean: reused
            with pytest.raises(tensorwire.Timeout):
                again.call("sleep", 30, timeout=0.2)  # killed: not reused
        assert pool.wait_idle(2, 60)  # the killed one replaced in the background
        a, b = pool.get(), pool.get()
        assert first not in (a.pid, b.pid) and a.pid != b.pid
        assert gone(first)
        a.release()
        b.release()


def _landlock() -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    SYS_landlock_create_ruleset = 444  # x86_64 and aarch64
    return libc.syscall(SYS_landlock_create_ruleset, None, ctypes.c_size_t(0), ctypes.c_uint32(1)) > 0


def test_a_sandboxed_worker_is_denied_files_network_and_exec_and_tensors_still_flow():
    if not _landlock():
        pytest.skip("this kernel has no landlock")
    # Outside every path the worker may read: the interpreter's prefixes, sys.path (which
    # holds the directory pytest runs in), this directory.
    allowed = [Path(p).resolve() for p in (*rpc._readable_python(), HERE)]
    home = Path(tempfile.mkdtemp(prefix="tw-sandbox-", dir=os.path.expanduser("~")))
    try:
        assert not any(home.is_relative_to(p) for p in allowed), f"{home} is under an allowed path"
        secret = home / "secret.txt"
        secret.write_text("not for workers")
        with spawn(sandbox=rpc.Sandbox(read=[HERE]), output="capture") as w:
            assert w.call("try_open", str(secret)) == "PermissionError: errno 13"
            assert w.call("try_inet") == "PermissionError: errno 1"
            assert w.call("try_exec") == "PermissionError: errno 1"
            x = torch.arange(64.0)
            assert torch.equal(w.call("scale", x, 3.0), x * 3.0)
            assert bool((w.call("fill", 1 << 16, 1.0) == 1.0).all())
    finally:
        shutil.rmtree(home)


@pytest.mark.parametrize("kind,says", [
    ("length", "frame of 4294967295 bytes"),  # a frame declaring 2^32 - 1 bytes
    ("deep", "max_depth"),  # a million nested arrays
    ("garbage", "decode"),  # bytes that are not JSON
    ("deep_result", "max_depth"),  # a response whose result nests a million arrays
    ("bad_result", r"invalid JSON at byte 57: expected a value"),  # a result that is not JSON
])
def test_a_hostile_worker_is_a_typed_error_and_the_host_serves_its_other_workers(worker, kind, says):
    with spawn() as w:
        pid = w.pid
        with pytest.raises(tensorwire.Refused, match=f"(?i){says}"):
            w.call("hostile", kind)
        wait_for("the hostile worker to be killed", lambda: gone(pid))
    assert worker.call("add", 20, 22) == 42
