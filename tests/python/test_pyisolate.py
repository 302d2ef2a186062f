"""tensorwire.pyisolate with pyisolate 0.10.2's real host and child processes
(pyisolate_host.py drives an ExtensionManager; the child is pyisolate's own uds_client
in a venv pyisolate creates): tensors travel as tensorwire exports both ways, and a
SIGKILLed child holding tensors leaves no lease, mapping or /dev/shm file behind."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("pyisolate", reason="pyisolate is not installed: SKIPPED (scripts/setup-venv.sh installs it)")

from support import connected_pair  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


@pytest.fixture(scope="module")
def host_env(tmp_path_factory):
    env = dict(os.environ)
    # pyisolate creates each child's venv with the `uv` binary; the project's own copy
    # (scripts/setup-venv.sh puts it in .tools/uv) serves where none is on PATH.
    if shutil.which("uv") is None and (ROOT / ".tools/uv/bin/uv").exists():
        env["PATH"] = f"{ROOT / '.tools/uv/bin'}{os.pathsep}{env.get('PATH', '')}"
        env.setdefault("UV_CACHE_DIR", str(ROOT / ".tools/uv-cache"))
    env["TW_VENV_ROOT"] = str(tmp_path_factory.mktemp("pyisolate-venvs"))
    return env


def run_host(env, scenario, adapter):
    cmd = [sys.executable, str(HERE / "pyisolate_host.py"), scenario, "--venv-root", env["TW_VENV_ROOT"]]
    if adapter:
        cmd.append("--adapter")
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    lines = [l for l in r.stdout.splitlines() if l.startswith("RESULT ")]
    # The host ends normally (no os._exit), after stop_all_extensions(): it must exit 0.
    # With the adapter it once aborted there (134, "terminate called without an active
    # exception": its accept thread was still inside a torch op at interpreter exit).
    assert r.returncode == 0 and lines, f"host failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    assert "terminate called" not in r.stderr, r.stderr
    return json.loads(lines[-1][len("RESULT "):])


def test_tensors_travel_as_tensorwire_exports_both_ways(host_env):
    out = run_host(host_env, "roundtrip", adapter=True)
    assert out["plain"]["is_tensor"] and out["plain"]["shape"] == [4, 3]
    assert out["segment_view"]["shape"] == [6, 4] and out["segment_view"]["stride"] == [1, 6]
    assert out["plain"]["sum"] == 66.0 and out["nested"] == 6.0
    assert out["flip_seen_by_host"] == 1.0  # the child wrote the host's segment: zero-copy
    assert out["made"] == [0.0, 1.0, 2.0, 3.0, 4.0] and out["echo_equal"]
    (stats,) = out["host_stats"].values()  # one child, one tensorwire connection
    assert stats["granted"] == 5, stats  # every tensor the host sent went through tensorwire


def test_sigkilled_child_leaves_nothing_behind(host_env):
    out = run_host(host_env, "sigkill", adapter=True)
    assert out["held_before_kill"] == 5
    assert out["after_kill"]["live_leases"] == 0 and out["after_kill"]["reclaimed"] == 5, out
    assert out["child_link_closed"]
    assert out["memfd_mappings_left"] == 0, out
    assert out["shm_files_left"] == [], out


def test_without_the_adapter_pyisolate_leaves_shm_files(host_env):
    """The baseline the adapter fixes (and proof the /dev/shm check can see a leak)."""
    out = run_host(host_env, "sigkill", adapter=False)
    assert any(f.startswith("torch_") for f in out["shm_files_left"]), out


def test_a_hostile_peer_cannot_grow_the_stash_or_forge_references(monkeypatch):
    """Tensors no message names are held only up to a bound; a reference must carry a
    positive int tag; references outside a tensorwire transport are refused."""
    import torch

    import tensorwire
    import tensorwire.pyisolate as twp

    a, b = connected_pair()
    with a, b:
        sender, receiver = twp._Link(a), twp._Link(b)
        monkeypatch.setattr(twp, "MAX_STASHED", 3)
        refs = [sender.export(torch.full((2,), float(i))) for i in range(5)]
        assert torch.equal(receiver.take(refs[1]["tag"]), torch.full((2,), 1.0))  # out of order is fine
        with pytest.raises(tensorwire.Error, match="no message named"):
            receiver.take(refs[4]["tag"])  # tag 2 taken; 1, 3, 4 stashed: full before 5 arrives
    for bad in ({"__type__": twp.TYPE_NAME}, {"__type__": twp.TYPE_NAME, "tag": "1"},
                {"__type__": twp.TYPE_NAME, "tag": -3}, {"__type__": twp.TYPE_NAME, "tag": True}):
        with pytest.raises(tensorwire.Error, match="positive int tag"):
            twp._deserialize(bad)
    with pytest.raises(tensorwire.Error, match="outside a transport"):
        twp._deserialize({"__type__": twp.TYPE_NAME, "tag": 1})
