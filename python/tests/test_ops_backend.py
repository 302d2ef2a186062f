"""torch.ops.tensorwire on either backend: Python ops over tensorwire._native (the default)
or the C++ extension ($TENSORWIRE_TORCH_LIB). The same schemas, ops without tensor
arguments dispatching, the handle registry's answers after close."""

import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import tensorwire
from tensorwire._loader import BACKEND

ops = torch.ops.tensorwire
ROOT = Path(__file__).resolve().parents[2]
CPP_LIB = os.environ.get("TENSORWIRE_TORCH_LIB") or str(ROOT / "build/torch-ext/libtensorwire_torch.so")

DUMP_SCHEMAS = ("import json, sys, torch, tensorwire; "
                "print(json.dumps({n: str(getattr(torch.ops.tensorwire, n).default._schema) for n in sys.argv[1:]}))")


def _file_schemas():
    """The lines of python/tensorwire/ops.schemas (the one list both backends register),
    `, CONNECTION_OPTIONS` expanded from ffi/include/tensorwire.h's X-macro: read here on its
    own, not through _ops, so a reader that drops or bends a line disagrees."""
    options = "".join(f", int {name}={default}" for name, default in
                      re.findall(r"X\((\w+), (-?\d+)\)", (ROOT / "ffi/include/tensorwire.h").read_text()))
    lines = (ROOT / "python/tensorwire/ops.schemas").read_text().splitlines()
    return [line.strip().replace(", CONNECTION_OPTIONS", options) for line in lines
            if line.strip() and not line.lstrip().startswith("#")]


def _copies(text, names):
    """The op schemas (or TORCH_LIBRARY definitions) `text` spells out itself: a quoted
    string starting as a schema of an op does (its name, "(", then an argument's type or
    "() ->"), or an `m.def("` call."""
    found = re.findall(r'\bm\.def\(\s*"', text)
    found += [m for m in re.findall(r"""["']([a-z_]+)\((?:\)\s*->|(?:int|str|bool|Tensor|ScalarType)\b)""", text)
              if m in names]
    return found


def test_backend_follows_the_environment():
    assert BACKEND == ("torch-lib" if os.environ.get("TENSORWIRE_TORCH_LIB") else "native")
    kernel = torch._C._dispatch_dump("tensorwire::stats")
    if BACKEND == "native":
        assert "_ops.py" in kernel, kernel
    else:
        assert "_ops.py" not in kernel, kernel


def test_a_missing_torch_lib_says_so():
    env = dict(os.environ, TENSORWIRE_TORCH_LIB="/nonexistent/libtensorwire_torch.so")
    r = subprocess.run([sys.executable, "-c", "import tensorwire"], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0 and "TENSORWIRE_TORCH_LIB=/nonexistent/libtensorwire_torch.so does not exist" in r.stderr


def test_the_registered_ops_are_the_schema_file():
    # Whichever backend registered them (the Python ops, or the C++ extension under
    # TENSORWIRE_TORCH_LIB): every line of ops.schemas, as torch parses it, and no other op.
    from tensorwire import _ops

    schemas = _file_schemas()
    assert len(schemas) == 27
    assert list(_ops.SCHEMAS) == schemas
    registered = sorted(str(s) for s in torch._C._jit_get_all_schemas() if s.name.startswith("tensorwire::"))
    assert registered == sorted(str(torch._C.parse_schema(f"tensorwire::{s}")) for s in schemas)


def test_no_op_layer_keeps_a_copy_of_the_schemas():
    # Both op layers read ops.schemas; a schema written again in a source (an m.def of its
    # own, a Python list of them) could drift from it.
    names = {s.split("(", 1)[0] for s in _file_schemas()}
    sources = [*sorted((ROOT / "cpp/src").iterdir()), *sorted((ROOT / "python/tensorwire").glob("*.py"))]
    assert len(sources) > 20
    copies = {str(p.relative_to(ROOT)): c for p in sources if (c := _copies(p.read_text(), names))}
    assert copies == {}, "these sources spell op schemas out; add them to python/tensorwire/ops.schemas instead"


def test_a_copy_of_a_schema_is_found():
    names = {"empty", "send"}
    assert _copies('  m.def("send(int conn) -> bool");', names) == ['m.def("', "send"]
    assert _copies('SCHEMAS = ("empty(int[] size) -> Tensor", "send() -> ()")', names) == ["empty", "send"]
    assert _copies('raise TypeError("send() takes window"); "tensorwire.send: tag"; "resend(int x)"', names) == []


@pytest.mark.skipif(not os.environ.get("TENSORWIRE_TORCH_LIB"), reason="TENSORWIRE_TORCH_LIB does not name a C++ "
                    "extension built for this torch (scripts/test.sh's C++ step sets it)")
def test_both_backends_register_the_same_schemas():
    dumps = []
    for lib in (None, os.environ["TENSORWIRE_TORCH_LIB"]):
        env = {k: v for k, v in os.environ.items() if k != "TENSORWIRE_TORCH_LIB"}
        if lib:
            env["TENSORWIRE_TORCH_LIB"] = lib
        names = [d.split("(")[0] for d in _file_schemas()]
        r = subprocess.run([sys.executable, "-c", DUMP_SCHEMAS, *names], env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        dumps.append(json.loads(r.stdout))
    assert dumps[0] == dumps[1]
    assert len(dumps[0]) == 27


def _open_pair():
    a, b = ops.socketpair()
    out = {}
    th = threading.Thread(target=lambda: out.setdefault("b", ops.from_fd(b, handshake_timeout_ms=60_000)))
    th.start()
    ha = ops.from_fd(a, handshake_timeout_ms=60_000)
    th.join()
    return ha, out["b"]


def test_ops_without_tensor_arguments_dispatch():
    ha, hb = _open_pair()
    try:
        assert ops.peer_pid(ha) == os.getpid()
        t = ops.zeros([3, 4], dtype=torch.float64)
        assert ops.is_shared(t)
        assert ops.send(ha, t.t(), 7) is True
        got, tag = ops.recv(hb, 5000)
        assert tag == 7 and got.shape == (4, 3) and got.stride() == (1, 4) and got.dtype == torch.float64
        got[0, 1] = 5.0
        assert t[1, 0] == 5.0  # the same memory
        assert ops.stats(ha)[:3] == [1, 96, 1]
        ops.ring_send(hb, torch.arange(6, dtype=torch.int16).view(2, 3).t(), 9, 5000)
        r, tag = ops.ring_recv(ha, 5000)
        assert tag == 9 and r.tolist() == [[0, 3], [1, 4], [2, 5]] and r.is_contiguous()
        del got
        with pytest.raises(RuntimeError, match="TW_ERR_TIMEOUT"):
            ops.recv(hb, 0)
    finally:
        ops.close(ha)
        ops.close(hb)


def test_a_negative_tag_or_window_is_refused_by_name():
    # The extension's checks; the Python ops leave them to _native, which words them the same.
    ha, hb = _open_pair()
    try:
        for t in (tensorwire.zeros(2), torch.zeros(2)):  # a sealed segment, a private tensor (packed)
            with pytest.raises(RuntimeError, match="tensorwire.send: tag must be >= 0, got -1"):
                ops.send(ha, t, -1)
            with pytest.raises(RuntimeError, match="tensorwire.send: window_ms must be >= 0, got -5"):
                ops.send(ha, t, 0, -5)
        with pytest.raises(RuntimeError, match="tensorwire.ring_send: tag must be >= 0, got -3"):
            ops.ring_send(ha, torch.zeros(2), -3)
        assert ops.stats(ha)[:3] == [0, 0, 0]  # nothing was exported
        with pytest.raises(RuntimeError, match="TW_ERR_TIMEOUT"):
            ops.ring_recv(hb, 0)  # nor put in the ring
    finally:
        ops.close(ha)
        ops.close(hb)


def test_a_handle_used_after_close():
    ha, hb = _open_pair()
    ops.close(ha)
    ops.close(ha)  # idempotent
    for op, args in (("stats", ()), ("peer_pid", ()), ("recv", (0,)), ("ring_recv", (0,)),
                     ("send", (tensorwire.zeros(1),)), ("ring_send", (torch.zeros(1),))):
        with pytest.raises(RuntimeError, match=f"tensorwire.{op}: connection {ha} is closed or was never opened"):
            getattr(ops, op)(ha, *args)
    with pytest.raises(RuntimeError, match="TW_ERR_PEER_GONE"):
        ops.recv(hb, 5000)  # the peer sees the connection end
    ops.close(hb)
    with pytest.raises(RuntimeError, match=r"tensorwire.stats: connection 987654321 is closed or was never opened"):
        ops.stats(987654321)


def test_a_listener_used_after_close(tmp_path):
    path = str(tmp_path / "tw.sock")
    lst = ops.listen(path)
    done = {}
    th = threading.Thread(target=lambda: done.setdefault("c", ops.connect(path, handshake_timeout_ms=60_000)))
    th.start()
    hs = ops.accept(lst, timeout_ms=60_000, handshake_timeout_ms=60_000)
    th.join()
    assert ops.peer_pid(hs) == os.getpid()
    ops.close(hs)
    ops.close(done["c"])
    ops.close_listener(lst)
    ops.close_listener(lst)  # idempotent
    assert not os.path.exists(path)
    with pytest.raises(RuntimeError, match=f"tensorwire.accept: listener {lst} is closed or was never opened"):
        ops.accept(lst, timeout_ms=0)
    # The options are checked before the handle, as an opening op parses them first.
    with pytest.raises(RuntimeError, match="tensorwire: max_leases must be"):
        ops.accept(lst, timeout_ms=0, max_leases=-1)


def test_a_trusted_fd_tensor_is_sent_by_copy():
    s = torch.arange(8, dtype=torch.float32).share_memory_()
    fd, nbytes = s.untyped_storage()._share_fd_cpu_()
    t = ops.from_torch_fd(fd, nbytes, torch.float32, [2, 3], [3, 1], 1)
    assert t.tolist() == [[1, 2, 3], [4, 5, 6]]
    assert not ops.is_shared(t)  # unsealed: peers refuse it, so it is copied
    seg_fd, seg_len, off = ops.segment_fd(t)
    os.close(seg_fd)
    assert seg_len >= nbytes and off == 0
    ha, hb = _open_pair()
    try:
        assert ops.send(ha, t, 0) is False
        got, _ = ops.recv(hb, 5000)
        assert got.tolist() == t.tolist()
    finally:
        ops.close(ha)
        ops.close(hb)
