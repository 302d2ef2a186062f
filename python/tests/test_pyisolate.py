"""tensorwire.pyisolate with pyisolate 0.10.2's real host and child processes
(pyisolate_host.py drives an ExtensionManager; the child is pyisolate's own uds_client
in a venv pyisolate creates): tensors travel as tensorwire exports both ways; a
SIGKILLed child holding tensors leaves no lease, mapping or /dev/shm file behind; a
child slow to start, a child the host cannot pair and a sealed worker lose nothing and
wait for nothing; the adapter composes with pyisolate's reference adapters; a killed
host's listener directory is removed by the next host."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
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


#: How long the slow child sleeps before it bootstraps: past the fixed 10 s the host once
#: waited for a child's connection before deciding it had none.
SLOW_CHILD_S = 11
#: Hosts run at once (a host waits on its child much of the time: its start, a sleep).
PARALLEL_HOSTS = 2

#: Each host run: scenario, flags, extra environment (see pyisolate_host.py).
JOBS = {
    "slow": ("slow", ["--adapter"], {"TW_PYISOLATE_CHILD_DELAY_S": str(SLOW_CHILD_S)}),
    "roundtrip": ("roundtrip", ["--adapter"], {}),
    "sigkill": ("sigkill", ["--adapter"], {}),
    "sigkill_plain": ("sigkill", [], {}),
    "unpaired": ("unpaired", ["--adapter"], {}),
    "sealed": ("sealed", ["--adapter"], {}),
    "compose_reference": ("compose", ["--compose", "reference"], {}),
    "compose_mock": ("compose", ["--compose", "mock"], {}),
    "sandboxed": ("roundtrip", ["--adapter", "--sandbox"], {}),
}
#: Which host run each test reads.
TEST_JOB = {
    "test_tensors_travel_as_tensorwire_exports_both_ways": "roundtrip",
    "test_sigkilled_child_leaves_nothing_behind": "sigkill",
    "test_without_the_adapter_pyisolate_leaves_shm_files": "sigkill_plain",
    "test_a_slow_child_pairs_late_and_loses_nothing": "slow",
    "test_an_unpaired_child_gets_no_reference_and_sends_none": "unpaired",
    "test_a_sealed_worker_is_known_without_waiting_or_warning": "sealed",
    "test_composed_with_pyisolates_reference_harness_adapter": "compose_reference",
    "test_composed_adapter_serves_the_host_adapters_types_and_services": "compose_mock",
    "test_a_sandboxed_child_pairs_and_imports_the_adapter": "sandboxed",
}


def _bubblewrap() -> tuple[bool, str]:
    from pyisolate._internal.sandbox_detect import detect_sandbox_capability

    cap = detect_sandbox_capability()
    return cap.available, f"{cap.restriction_model}: {cap.raw_error}"


def _host_cmd(env, scenario, *flags, venv_root=None):
    return [sys.executable, str(HERE / "pyisolate_host.py"), scenario, "--venv-root",
            venv_root or env["TW_VENV_ROOT"], *flags]


def _run_job(env, key):
    scenario, flags, extra = JOBS[key]
    env = dict(env, **extra)
    if "TW_PYISOLATE_CHILD_DELAY_S" in extra:  # the child imports pyisolate_delay's sitecustomize
        env["PYTHONPATH"] = os.pathsep.join([str(HERE / "pyisolate_delay"), env.get("PYTHONPATH", "")])
    venv_root = os.path.join(env["TW_VENV_ROOT"], key)  # one venv per run: they start at once
    return subprocess.run(_host_cmd(env, scenario, *flags, venv_root=venv_root), env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.fixture(scope="module")
def hosts(host_env, request):
    """The host runs the selected tests read, started together (PARALLEL_HOSTS at a time);
    ``hosts(test_name)`` waits for that test's."""
    from concurrent.futures import ThreadPoolExecutor

    wanted = [k for k in JOBS if k in {TEST_JOB.get(item.name) for item in request.session.items}
              and (k != "sandboxed" or _bubblewrap()[0])]
    pool = ThreadPoolExecutor(max_workers=PARALLEL_HOSTS)
    futures = {k: pool.submit(_run_job, host_env, k) for k in wanted}

    def result(test_name):
        r = futures[TEST_JOB[test_name]].result()
        lines = [l for l in r.stdout.splitlines() if l.startswith("RESULT ")]
        # The host ends normally (no os._exit), after stop_all_extensions(): it must exit 0.
        # With the adapter it once aborted there (134, "terminate called without an active
        # exception": its accept thread was still inside a torch op at interpreter exit).
        assert r.returncode == 0 and lines, f"host failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
        assert "terminate called" not in r.stderr, r.stderr
        return json.loads(lines[-1][len("RESULT "):]), r.stdout + r.stderr

    yield result
    pool.shutdown(wait=True)


def run_host(hosts, request):
    return hosts(request.node.name)[0]


def test_tensors_travel_as_tensorwire_exports_both_ways(hosts, request):
    out = run_host(hosts, request)
    assert out["plain"]["is_tensor"] and out["plain"]["shape"] == [4, 3]
    assert out["segment_view"]["shape"] == [6, 4] and out["segment_view"]["stride"] == [1, 6]
    assert out["plain"]["sum"] == 66.0 and out["nested"] == 6.0
    assert out["flip_seen_by_host"] == 1.0  # the child wrote the host's segment: zero-copy
    assert out["made"] == [0.0, 1.0, 2.0, 3.0, 4.0] and out["echo_equal"]
    assert out["made_is_shared"]  # the child's tensor came through tensorwire too
    (stats,) = out["host_stats"].values()  # one child, one tensorwire connection
    assert stats["granted"] == 5, stats  # every tensor the host sent went through tensorwire


def test_sigkilled_child_leaves_nothing_behind(hosts, request):
    out = run_host(hosts, request)
    assert out["held_before_kill"] == 5
    assert out["after_kill"]["live_leases"] == 0 and out["after_kill"]["reclaimed"] == 5, out
    assert out["child_link_closed"]
    assert out["memfd_mappings_left"] == 0, out
    assert out["shm_files_left"] == [], out


def test_without_the_adapter_pyisolate_leaves_shm_files(hosts, request):
    """The baseline the adapter fixes (and proof the /dev/shm check can see a leak)."""
    out = run_host(hosts, request)
    assert any(f.startswith("torch_") for f in out["shm_files_left"]), out


def test_a_hostile_peer_cannot_grow_the_stash_or_forge_references(monkeypatch):
    """Tensors no message names are held only up to a bound; a reference must carry a
    positive int tag; references outside a tensorwire transport are refused."""
    import torch

    import tensorwire
    import tensorwire._pyisolate_link as twl
    import tensorwire.pyisolate as twp

    a, b = connected_pair()
    with a, b:
        sender, receiver = twp._Link(a), twp._Link(b)
        monkeypatch.setattr(twl, "MAX_STASHED", 3)
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


def test_a_slow_child_pairs_late_and_loses_nothing(hosts, request):
    """The first call, carrying a tensor, leaves while the child is still asleep (its
    bootstrap delayed past the 10 s the host once waited before deciding the child had no
    tensorwire connection, after which the child's first tensorwire answer ended
    pyisolate's receive loop). Nothing waits: the first tensor travels by pyisolate's
    path, and once the child's hello is acknowledged every later one through tensorwire,
    both ways."""
    out = run_host(hosts, request)
    assert out["first"]["shape"] == [2, 3] and out["first"]["sum"] == 6.0
    assert out["first_call_s"] > SLOW_CHILD_S  # the delay did happen before the child answered
    (first,) = out["stats_after_first"].values()  # paired once the child answered (hello first)
    assert out["made"] == [0.0, 1.0, 2.0, 3.0] and out["made_is_shared"]  # child -> host: tensorwire
    assert out["echo_equal"] and out["second"]["sum"] == 3.0
    (stats,) = out["stats"].values()
    assert stats["granted"] - first["granted"] == 2, (first, stats)  # host -> child after pairing: tensorwire


def test_an_unpaired_child_gets_no_reference_and_sends_none(hosts, request):
    """The child holds a tensorwire connection, but to a listener that is not this
    host's: the host cannot pair it and does not acknowledge its hello. Neither side may
    then send a reference, so every tensor travels by pyisolate's path both ways, and
    the host says why."""
    out, logs = hosts(request.node.name)
    assert out["made"] == [0.0, 1.0, 2.0] and out["echo_equal"] and out["info"]["sum"] == 2.0
    assert out["stats"] == {}, out  # nothing went through this host's listener
    assert "tensorwire connection did not arrive" in logs, logs


def test_a_sealed_worker_is_known_without_waiting_or_warning(hosts, request):
    """A sealed worker gets no adapter (pyisolate's bootstrap says so): the host expects
    no connection from it, sends its tensors by pyisolate's JSON path at once, and logs
    nothing about tensorwire."""
    out, logs = hosts(request.node.name)
    assert out["shape"] == [2, 5] and out["shape2"] == [3]
    assert not out["paired"]
    assert "tensorwire.pyisolate" not in logs, logs  # the adapter's log lines all start so


def test_composed_with_pyisolates_reference_harness_adapter(hosts, request):
    """compose(ReferenceAdapter): the child rehydrates the same composite around a new
    ReferenceAdapter, and tensors still travel through tensorwire."""
    out = run_host(hosts, request)
    want = {"type": "Composed[pyisolate_reference_adapters:ReferenceAdapter]", "identifier": "reference_harness",
            "inner": "ReferenceAdapter"}
    assert out["child_adapter"] == want and out["host_adapter"] == want
    assert out["echo_equal"] and out["made"] == [0.0, 1.0, 2.0]
    (stats,) = out["stats"].values()
    assert stats["granted"] == 1, stats


def test_composed_adapter_serves_the_host_adapters_types_and_services(hosts, request):
    """compose(MockHostAdapter), pyisolate's reference IsolationAdapter: its own type
    crosses both ways by its serializers, its RPC service reaches the child, and
    tensors travel through tensorwire."""
    out = run_host(hosts, request)
    assert out["child_adapter"]["identifier"] == "testhost" and out["child_adapter"]["inner"] == "MockHostAdapter"
    # Its serializer ran in the host (the child got its form) and in the child (so did we).
    assert out["mock_double"] == [{"__testdata__": True, "value": 21}, {"__testdata__": True, "value": 42}]
    assert out["registry_kind"] == "CallWrapper"  # MockRegistry is the host's, called by RPC
    assert out["echo_equal"] and out["made"] == [0.0, 1.0, 2.0]
    (stats,) = out["stats"].values()
    assert stats["granted"] == 1, stats


def test_a_sandboxed_child_pairs_and_imports_the_adapter(hosts, request):
    """In bubblewrap (pyisolate's default sandbox: its own /tmp, pid and network
    namespaces) the child imports the adapter from the directory the adapter binds, reaches
    the listener's directory, and pairs by the pid the kernel reports in the host's
    namespace."""
    available, why = _bubblewrap()
    if not available:
        pytest.skip(f"bubblewrap cannot sandbox here ({why}): SKIPPED")
    out = run_host(hosts, request)
    assert out["plain"]["pid"] not in [int(p) for p in out["host_stats"]]  # another pid namespace
    assert out["made"] == [0.0, 1.0, 2.0, 3.0, 4.0] and out["made_is_shared"] and out["echo_equal"]
    (stats,) = out["host_stats"].values()
    assert stats["granted"] == 5, stats


def _listener_dirs(tmp):
    return sorted(n for n in os.listdir(tmp) if n.startswith("tensorwire-pyisolate-"))


def test_a_killed_hosts_listener_dir_is_removed_by_the_next_host(host_env):
    """A host killed by SIGKILL cannot remove its listener's directory; the next host
    start does (its owner is gone), and keeps those of hosts still running."""
    import tempfile

    import tensorwire._pyisolate_link as twp

    # Short: the listener's socket path must fit in 107 bytes.
    tmp = Path(tempfile.mkdtemp(prefix="twk-", dir="/tmp"))
    try:
        env = dict(host_env, TMPDIR=str(tmp))
        cmd = _host_cmd(env, "hold", "--adapter", venv_root=os.path.join(env["TW_VENV_ROOT"], "hold"))
        errors = tempfile.TemporaryFile("w+")
        host = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=errors, text=True)
        child = None
        try:
            for line in host.stdout:
                if line.startswith("READY "):
                    ready = json.loads(line[len("READY "):])
                    child = ready["child"]
                    break
            errors.seek(0)
            assert child is not None, f"host ended before it was ready:\n{errors.read()}"
            assert str(child) in ready["stats"]  # paired: the listener was in use
            (mine,) = _listener_dirs(tmp)
            assert mine.startswith(f"tensorwire-pyisolate-{ready['host']}-")
            host.send_signal(signal.SIGKILL)
            host.wait(timeout=30)
        finally:
            if host.poll() is None:
                host.kill()
            host.wait()
            if child is not None:
                try:
                    os.kill(child, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        assert _listener_dirs(tmp) == [mine]  # left behind by the killed host
        # One of a host that is running (this process) stays; one holding anything but the
        # socket is not removed either.
        live = tmp / f"tensorwire-pyisolate-{os.getpid()}-{twp._start_time(os.getpid())}-live"
        live.mkdir()
        odd = tmp / "tensorwire-pyisolate-1-1-odd"
        odd.mkdir()
        (odd / "other").write_text("x")
        nxt = subprocess.run([sys.executable, "-c", "from tensorwire.pyisolate import TensorwireAdapter; "
                              "TensorwireAdapter()"], env=env, capture_output=True, text=True, timeout=120)
        assert nxt.returncode == 0, nxt.stderr
        assert _listener_dirs(tmp) == sorted([live.name, odd.name])  # the killed host's is gone; its own too
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_a_reference_that_cannot_be_taken_does_not_end_the_receive_loop():
    """A TensorwireTensor on a transport with no agreed pairing: a response becomes an
    error for its call, a call is answered with an error response and not run, and the
    transport goes on receiving (pyisolate's receive loop ends on any exception)."""
    import socket

    from pyisolate._internal.rpc_transports import JSONSocketTransport
    from pyisolate._internal.serialization_registry import SerializerRegistry

    import tensorwire.pyisolate as twp

    twp._wrap_transport()
    registry = SerializerRegistry.get_instance()
    registry.register(twp.TYPE_NAME, lambda ref: ref, twp._deserialize)
    a, b = socket.socketpair()
    mine, peer = JSONSocketTransport(a), JSONSocketTransport(b)
    ref = {"__type__": twp.TYPE_NAME, "tag": 1}
    try:
        twp._orig_send(peer, {"kind": "response", "call_id": 7, "result": {"t": ref}, "error": None})
        twp._orig_send(peer, {"kind": "call", "object_id": "extension", "call_id": 8, "parent_call_id": None,
                              "method": "info", "args": [ref], "kwargs": {}})
        twp._orig_send(peer, {"kind": "response", "call_id": 9, "result": 1, "error": None})
        got = mine.recv()
        assert got["call_id"] == 7 and got["result"] is None and "agreed tensorwire connection" in got["error"]
        assert mine.recv() == {"kind": "response", "call_id": 9, "result": 1, "error": None}  # the call was skipped
        answer = twp._orig_recv(peer)
        assert answer["call_id"] == 8 and answer["result"] is None and "agreed tensorwire connection" in answer["error"]
    finally:
        registry._deserializers.pop(twp.TYPE_NAME, None)
        registry._serializers.pop(twp.TYPE_NAME, None)
        mine.close()
        peer.close()


def test_a_composed_adapter_keeps_pyisolates_optional_hooks_optional(monkeypatch):
    """pyisolate's reference harness adapter has no sandbox, web or event hooks (pyisolate
    calls them only where they exist): the composite answers them itself, and a sandboxed
    child still gets the listener's directory and this package's bound."""
    import tensorwire
    import tensorwire.pyisolate as twp
    from pyisolate_reference_adapters import ReferenceAdapter

    monkeypatch.setenv("PYISOLATE_CHILD", "1")  # as in a child: no listener started here
    monkeypatch.setenv(twp.SOCKET_ENV, "/run/tw-test/tw.sock")
    adapter = twp.compose(ReferenceAdapter())
    assert adapter.get_sandbox_system_paths() == ["/run/tw-test", os.path.dirname(tensorwire.__file__)]
    assert adapter.get_sandbox_gpu_patterns() is None
    adapter.setup_web_directory(object())
    adapter.setup_child_event_hooks(object())
    assert adapter.provide_rpc_services() == [] and adapter.identifier == "reference_harness"
    with pytest.raises(ValueError, match="cannot be rehydrated"):
        twp.compose(type("Local", (), {})())  # defined in a function: no child could import it
