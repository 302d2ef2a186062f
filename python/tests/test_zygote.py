"""Workers forked from a zygote (``spawn(..., zygote=True)``): they serve calls and
tensors, start far faster than an exec'd worker, are the supervisor's children, are
replaced from the zygote after a kill or a crash, and neither the zygote nor a worker
outlives the supervisor. A sandboxed worker is forked from the zygote too, contained
before its Python runs again, and imports its target itself (the zygote never does);
``python/tests/test_containment.py`` runs the escape suite in one."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import tensorwire.rpc as rpc

HERE = str(Path(__file__).resolve().parent)
ENV = {"PYTHONPATH": HERE}


def spawn(marker: Path | None = None, **kw):
    env = dict(ENV)
    if marker is not None:
        env["ZYGOTE_MARKER"] = str(marker)
    kw.setdefault("timeout", 60.0)
    return rpc.spawn("zygote_targets:Plugin", env=env, **kw)


def ppid_of(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


def zygotes_of(parent: int, *workers: int) -> list[int]:
    """The zygotes among ``parent``'s children (a forked worker shares its zygote's
    command line: the ``workers`` are left out)."""
    found = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            cmd = (p / "cmdline").read_bytes().split(b"\0")
            if b"tensorwire.zygote" in cmd and ppid_of(int(p.name)) == parent and int(p.name) not in workers:
                found.append(int(p.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


def importers(marker: Path) -> list[int]:
    return [int(x) for x in marker.read_text().split()] if marker.exists() else []


def test_zygote_worker_serves_calls_and_tensors_as_our_child(tmp_path):
    marker = tmp_path / "imports"
    with spawn(marker, zygote=True) as w:
        assert w.call("add", 2, 3) == 5
        x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
        assert torch.equal(w.call("scale", x, 3.0), x * 3.0)
        assert w.call("torch_imported")
        pid = w.call("pid")
        assert pid == w.pid
        # Forked with CLONE_PARENT: the supervisor's child, not the zygote's.
        assert w.call("ppid") == os.getpid()
        (zygote,) = zygotes_of(os.getpid(), pid)
        # The target's module was imported once, by the zygote, not by the worker.
        assert importers(marker) == [zygote]
    # Closing the worker ends its zygote too.
    assert not Path(f"/proc/{zygote}").exists()


def test_replacements_after_kill_and_crash_come_from_the_zygote(tmp_path):
    marker = tmp_path / "imports"
    with spawn(marker, zygote=True) as w:
        first = w.call("pid")
        w.kill()
        second = w.call("pid")
        assert second != first
        with pytest.raises(rpc.PeerGone if hasattr(rpc, "PeerGone") else Exception):
            w.call("crash")
        third = w.call("pid")
        assert third not in (first, second)
        assert w.call("ppid") == os.getpid()
        # Still one import of the target: every worker was forked from the same zygote.
        assert importers(marker) == zygotes_of(os.getpid(), third)
        assert len(importers(marker)) == 1


def median_restart(w) -> float:
    """The median of five starts of ``w``'s replacement after a kill (the zygote warm)."""
    w.call("add", 1, 1)  # the zygote is warm from here on
    starts = []
    for _ in range(5):
        w.kill()
        t = time.perf_counter()
        assert w.call("add", 1, 2) == 3
        starts.append(time.perf_counter() - t)
    return sorted(starts)[len(starts) // 2]


def test_a_worker_from_the_zygote_starts_much_faster_than_an_exec(tmp_path):
    t = time.perf_counter()
    with spawn() as w:
        w.call("add", 1, 1)
        exec_start = time.perf_counter() - t
    with spawn(zygote=True) as w:
        median = median_restart(w)
    assert median < exec_start / 5, (median, exec_start)


def test_output_of_a_zygote_worker_is_captured():
    with spawn(zygote=True, output="capture") as w:
        assert w.call("say", "hello from the fork")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            out, err = w.output()
            if b"hello from the fork" in out and b"err:hello from the fork" in err:
                break
            time.sleep(0.02)
        out, err = w.output()
        assert b"hello from the fork" in out and b"err:hello from the fork" in err


def test_a_dead_zygote_is_restarted_on_the_next_start():
    with spawn(zygote=True) as w:
        (zygote,) = zygotes_of(os.getpid(), w.call("pid"))
        os.kill(zygote, signal.SIGKILL)
        # The running worker does not die with its zygote.
        assert w.call("add", 2, 2) == 4
        # A start that finds its zygote dead brings up a fresh one; a start whose zygote
        # could not come up in time (a loaded machine) falls back to exec, and the next
        # start tries again: a few starts, each of which must serve.
        new: list = []
        for _ in range(3):
            w.kill()
            assert w.call("add", 3, 3) == 6
            assert w.call("ppid") == os.getpid()
            new = zygotes_of(os.getpid(), w.call("pid"))
            if new:
                break
        assert len(new) == 1 and new[0] != zygote


def test_the_zygote_and_its_workers_end_with_the_supervisor(tmp_path):
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {HERE!r})
        import tensorwire.rpc as rpc
        w = rpc.spawn("zygote_targets:Plugin", env={ENV!r}, zygote=True)
        pid = w.call("pid")
        w.kill()
        pid2 = w.call("pid")
        print(pid2, flush=True)
        sys.stdin.readline()
        # The worker busy holding its GIL: only its death signal can end it.
        import threading, time
        threading.Thread(target=w.call, args=("hold_gil", 600), daemon=True).start()
        time.sleep(1.0)
        os.kill(os.getpid(), 9)
    """)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(rpc.__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    p = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
    try:
        worker = int(p.stdout.readline())
        zygotes = zygotes_of(p.pid, worker)
        assert len(zygotes) == 1
        assert ppid_of(worker) == p.pid
        p.stdin.write("\n")
        p.stdin.flush()
        p.wait(timeout=30)
    finally:
        p.kill()
    deadline = time.monotonic() + 10
    left = [worker, *zygotes]
    while time.monotonic() < deadline:
        left = [q for q in left if Path(f"/proc/{q}").exists() and Path(f"/proc/{q}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"]
        if not left:
            break
        time.sleep(0.05)
    assert not left, f"left running after the supervisor died: {left}"


def test_a_sandboxed_worker_comes_from_the_zygote_but_imports_its_target_itself(tmp_path):
    if not rpc._native.containment()["user_namespaces"]:
        pytest.skip("no user namespaces here")
    marker = tmp_path / "imports"
    box = rpc.Sandbox(read=[HERE], write=[str(tmp_path)])
    with spawn(marker, zygote=True, sandbox=box) as w:
        assert w.call("add", 1, 2) == 3
        zygotes = zygotes_of(os.getpid(), w.pid)
        assert len(zygotes) == 1, f"the sandboxed worker was not forked from a zygote: {zygotes}"
        w.kill()
        assert w.call("add", 2, 2) == 4
        assert zygotes_of(os.getpid(), w.pid) == zygotes, "the replacement came from another zygote"
    # Each import is a worker's own, inside its containment (pid 1 of its namespace);
    # the zygote never imported the target.
    assert importers(marker) == [1, 1]


def test_a_sandboxed_worker_from_the_zygote_starts_much_faster_than_an_exec(tmp_path):
    if not rpc._native.containment()["user_namespaces"]:
        pytest.skip("no user namespaces here")
    box = rpc.Sandbox(read=[HERE])
    t = time.perf_counter()
    with spawn(sandbox=box) as w:
        w.call("add", 1, 1)
        exec_start = time.perf_counter() - t
    with spawn(zygote=True, sandbox=box) as w:
        median = median_restart(w)
    assert median < exec_start / 5, (median, exec_start)


def test_preload_needs_zygote_and_a_command_cannot_have_one():
    with pytest.raises(ValueError, match="zygote"):
        spawn(preload=["json"])
    with pytest.raises(ValueError, match="zygote"):
        rpc.spawn(command=[sys.executable, "-c", "pass"], zygote=True)


def test_a_pool_forks_its_workers_from_one_zygote_by_default(tmp_path):
    marker = tmp_path / "imports"
    env = {**ENV, "ZYGOTE_MARKER": str(marker)}
    with rpc.WorkerPool("zygote_targets:Plugin", 2, env=env, timeout=60.0) as pool:
        assert pool.wait_idle(2, 60)
        a, b = pool.get(), pool.get()
        pids = [a.call("pid"), b.call("pid")]
        assert [a.call("ppid"), b.call("ppid")] == [os.getpid(), os.getpid()]
        a.kill()
        a.release()
        b.release()
        assert pool.wait_idle(2, 60)  # the killed one replaced, from the zygote
        (zygote,) = zygotes_of(os.getpid(), *pids, *[w.pid for w in (pool.get(), pool.get())])
        assert importers(marker) == [zygote]
    # zygote=False: every worker imports its target itself.
    marker.unlink()
    with rpc.WorkerPool("zygote_targets:Plugin", 2, env=env, timeout=60.0, zygote=False) as pool:
        assert pool.wait_idle(2, 60)
        assert len(importers(marker)) == 2
