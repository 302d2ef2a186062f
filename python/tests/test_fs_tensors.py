"""pyisolate's file-system tensors from a hostile peer: a ``TensorRef`` names a
``/dev/shm`` file, and the host never opens one unless the endpoint asked for them
(``fs_tensors=True``; workers never do). Asked for, another program's file is only read:
not written, not unlinked, not left mapped."""
from __future__ import annotations

import os
import struct
import sys
from pathlib import Path

import pytest
import torch

import tensorwire
import tensorwire.rpc as rpc

HERE = str(Path(__file__).resolve().parent)
sys.path.insert(0, HERE)
from fs_targets import Liar, tensor_ref  # noqa: E402


class OtherProgramsFile:
    """A torch file_system file "another program" made: refcount 1 at offset 0, four
    float32 at 64."""

    def __init__(self, tag):
        self.key = f"/tw_pytest_{tag}_{os.getpid()}"
        self.path = Path("/dev/shm" + self.key)
        self.bytes = struct.pack("=i", 1) + bytes(60) + struct.pack("=4f", 1.0, 2.0, 3.0, 4.5)
        self.path.write_bytes(self.bytes)

    def assert_untouched(self):
        assert self.path.exists(), f"{self.path} was unlinked"
        assert self.path.read_bytes() == self.bytes, f"{self.path} was written"
        maps = Path("/proc/self/maps").read_text()
        assert str(self.path) not in maps, f"{self.path} is still mapped here"

    def remove(self):
        self.path.unlink(missing_ok=True)


@pytest.fixture
def other():
    f = OtherProgramsFile("other")
    yield f
    f.remove()


def test_a_worker_returning_a_tensor_ref_is_refused_and_the_file_untouched(other):
    with rpc.spawn("fs_targets:Liar", env={"PYTHONPATH": HERE}, timeout=60.0) as w:
        for strategy in ("file_system", "file_system_borrowed"):
            with pytest.raises(tensorwire.Refused, match="accept_fs_tensors.*fs_tensors=True"):
                w.call("give", other.key, strategy)
            other.assert_untouched()
        # The worker still serves: a refused value is the call's error, nothing more.
        with pytest.raises(tensorwire.Refused, match="accept_fs_tensors"):
            w.call("give", other.key)
    other.assert_untouched()


def test_pair_refuses_fs_tensors_unless_asked(other):
    a, b = rpc.pair(serve_b={"liar": Liar()}, native=False)
    try:
        with pytest.raises(tensorwire.Refused, match="accept_fs_tensors"):
            a.call("liar", "give", other.key)
        other.assert_untouched()
    finally:
        a.close()
        b.close()


def test_pair_with_fs_tensors_reads_another_programs_file_and_leaves_it(other):
    a, b = rpc.pair(serve_b={"liar": Liar()}, native=False, fs_tensors=True)
    try:
        for strategy in ("file_system", "file_system_borrowed"):
            t = a.call("liar", "give", other.key, strategy)
            assert t.tolist() == [1.0, 2.0, 3.0, 4.5]
            t.add_(1)  # a copy of ours: the file is not written
            del t
            other.assert_untouched()
        # A path out of /dev/shm, a symlink: refused even when asked for.
        link = Path(f"/dev/shm/tw_pytest_link_{os.getpid()}")
        link.symlink_to(other.path)
        try:
            for key in ("/.." + other.key, "/../shm" + other.key, "/" + link.name):
                with pytest.raises(tensorwire.Refused):
                    a.call("liar", "give", key)
        finally:
            link.unlink()
        other.assert_untouched()
    finally:
        a.close()
        b.close()
    other.assert_untouched()


class Summer:
    def total(self, t):
        return float(t.sum())


def _connected(path, serve_listener, serve_client, listener_fs=False, client_fs=False):
    listener = rpc.Listener(path, serve_listener, fs_tensors=listener_fs)
    client = rpc.connect(path, serve_client, fs_tensors=client_fs)
    return listener, client, listener.accept()


@pytest.mark.parametrize("asked", [False, True])
def test_connect_and_listener_read_fs_tensors_only_when_asked(tmp_path, other, asked):
    # The client receives one in a response.
    listener, client, served = _connected(str(tmp_path / "a.sock"), {"liar": Liar()}, None, client_fs=asked)
    try:
        if asked:
            assert client.call("liar", "give", other.key, timeout=30).tolist() == [1.0, 2.0, 3.0, 4.5]
        else:
            with pytest.raises(tensorwire.Refused, match="accept_fs_tensors"):
                client.call("liar", "give", other.key, timeout=30)
    finally:
        client.close()
        served.close()
    other.assert_untouched()
    # The listener's connection receives one as an argument.
    listener, client, served = _connected(str(tmp_path / "b.sock"), {"sum": Summer()}, None, listener_fs=asked)
    try:
        if asked:
            assert client.call("sum", "total", tensor_ref(other.key), timeout=30) == 10.5
        else:
            with pytest.raises(rpc.RemoteError, match="accept_fs_tensors"):
                client.call("sum", "total", tensor_ref(other.key), timeout=30)
    finally:
        client.close()
        served.close()
    other.assert_untouched()
