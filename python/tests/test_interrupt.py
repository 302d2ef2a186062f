"""Interrupting blocking calls (Ctrl-C, a cancelled asyncio task) and what the worker's
``on_interrupt`` policy does then; callable targets and constructor arguments; the pool
waiting for a warm worker, and a killed worker's replacement started in the background.
The Ctrl-C cases run a host process of their own (``interrupt_host.py``) and send it
SIGINT."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import tensorwire
import tensorwire.rpc as rpc
from support import gone, wait_for

HERE = str(Path(__file__).resolve().parent)
ENV = {"PYTHONPATH": HERE}
PYTHONPATH = os.pathsep.join([str(Path(rpc.__file__).resolve().parent.parent), HERE])


def spawn(target: str = "interrupt_targets:Sleeper", **kw):
    kw.setdefault("timeout", 120.0)  # no call in these tests may hang the run
    return rpc.spawn(target, env=ENV, **kw)


# ---- Ctrl-C during a blocking call -------------------------------------------------------

def interrupt_host(mode: str) -> tuple[float, dict]:
    """Run ``interrupt_host.py mode``, SIGINT it a second into its blocking call; the
    seconds from the signal to its ``except KeyboardInterrupt``, and its report."""
    host = subprocess.Popen([sys.executable, os.path.join(HERE, "interrupt_host.py"), mode],
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": PYTHONPATH})
    try:
        assert host.stdout.readline().strip() == "CALLING"
        time.sleep(1.0)  # the call is out and blocking
        sent = time.monotonic()  # CLOCK_MONOTONIC, as the host's
        host.send_signal(signal.SIGINT)
        out, _ = host.communicate(timeout=180)
    finally:
        host.kill()
    line = next((ln for ln in out.splitlines() if ln.startswith("REPORT ")), None)
    assert line, f"the host ended ({host.returncode}) without a report: {out!r}"
    report = json.loads(line[len("REPORT "):])
    assert report["interrupted_at"] is not None, "the call returned instead of raising KeyboardInterrupt"
    latency = report["interrupted_at"] - sent
    print(f"{mode}: KeyboardInterrupt {latency * 1e3:.1f} ms after SIGINT")
    return latency, report


def test_ctrl_c_interrupts_a_worker_call_and_kills_the_worker():
    latency, report = interrupt_host("kill")
    assert latency < 0.5, f"KeyboardInterrupt came {latency:.3f} s after the signal"
    assert report["before_gone"], "the interrupted worker still runs"
    assert report["after"] != report["before"], "the next call did not go to a fresh worker"


def test_ctrl_c_with_abandon_keeps_the_worker():
    latency, report = interrupt_host("abandon")
    assert latency < 0.5, f"KeyboardInterrupt came {latency:.3f} s after the signal"
    assert not report["before_gone"] and report["after"] == report["before"]


@pytest.mark.parametrize("mode", ["endpoint", "pending"])
def test_ctrl_c_interrupts_an_endpoint_call_and_abandons_it(mode):
    latency, report = interrupt_host(mode)
    assert latency < 0.5, f"KeyboardInterrupt came {latency:.3f} s after the signal"
    assert report["pending_calls"] == 0, "the abandoned call is still waited for"
    assert report["after"] == 0


def test_ctrl_c_interrupts_a_spawn_waiting_for_its_handshake():
    latency, _ = interrupt_host("spawn")
    assert latency < 0.5, f"KeyboardInterrupt came {latency:.3f} s after the signal"


# ---- cancelling an acall ---------------------------------------------------------------

def cancel_after(coro, seconds: float) -> float:
    """Run ``coro`` as a task, cancel it after ``seconds``; how long the cancel took to
    end the task."""
    async def run() -> float:
        task = asyncio.ensure_future(coro)
        await asyncio.sleep(seconds)
        t = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return time.monotonic() - t
    return asyncio.run(run())


def test_cancelling_an_acall_kills_the_worker_by_default():
    with spawn() as w:
        pid = w.call("pid")
        took = cancel_after(w.acall("sleep", 30), 1.0)
        assert took < 0.5, f"the cancelled task ended {took:.3f} s after the cancel"
        wait_for("the worker to be killed", lambda: gone(pid))
        assert w.call("pid") not in (None, pid)


def test_cancelling_an_acall_with_abandon_keeps_the_worker():
    with spawn(on_interrupt="abandon") as w:
        pid = w.call("pid")
        t = time.monotonic()
        took = cancel_after(w.acall("sleep", 3), 1.0)
        assert took < 0.5, f"the cancelled task ended {took:.3f} s after the cancel"
        assert not gone(pid) and w.call("pid") == pid
        time.sleep(max(0.0, 3.5 - (time.monotonic() - t)))  # the abandoned call ended
        # Its answer came and was dropped; a worker once abandoned is not clean (a pool
        # would not hand it out again: it might still be running the call).
        assert not w.is_clean()
        assert w.call("pid") == pid


def test_cancelling_an_endpoint_acall_abandons_it():
    opened, done = threading.Event(), threading.Event()

    class Gate:
        def wait(self):
            try:
                return opened.wait(30)
            finally:
                done.set()

    a, b = rpc.pair(serve_b={"gate": Gate()})
    took = cancel_after(a.acall("gate", "wait"), 0.5)
    assert took < 0.5, f"the cancelled task ended {took:.3f} s after the cancel"
    assert a._native.pending_calls == 0
    # The handler still runs (abandoned, not stopped); let it end before closing.
    assert not done.is_set()
    opened.set()
    assert done.wait(10)
    a.close()
    b.close()


def test_on_interrupt_is_checked():
    with pytest.raises(ValueError, match="on_interrupt"):
        rpc.spawn("interrupt_targets:Sleeper", env=ENV, on_interrupt="ignore")


# ---- targets: functions, constructor arguments, missing methods --------------------------

def test_a_function_target_is_called_as_the_worker_itself():
    with spawn("interrupt_targets:double") as w:
        assert w(21) == 42
        assert w(1, plus=5) == 7
        assert w.call("__call__", 2) == 4


def test_a_class_target_takes_constructor_arguments():
    with spawn("interrupt_targets:Scaled", init_args=(3,), init_kwargs={"offset": 1}) as w:
        assert w.call("apply", 2) == 7
        # The arguments are not left in the worker's environment.
        assert w.call("apply", 0) == 1


def test_constructor_arguments_must_be_json_and_for_a_class():
    with pytest.raises(ValueError, match="JSON"):
        rpc.spawn("interrupt_targets:Scaled", env=ENV, init_args=(object(),))
    with pytest.raises(tensorwire.PeerGone, match="not a class"):
        rpc.spawn("interrupt_targets:double", env=ENV, init_args=(1,), output="capture")


def test_a_missing_method_is_an_attribute_error_naming_it():
    with spawn("interrupt_targets:Scaled", init_args=(2,)) as w:
        with pytest.raises(tensorwire.RemoteError) as e:
            w.call("nope", 1)
        assert e.value.remote_type == "AttributeError"
        assert "'nope'" in str(e.value) and "'Scaled'" in str(e.value) and "apply" in str(e.value)
        with pytest.raises(tensorwire.RemoteError) as e:
            w(1)  # a class's instance without __call__
        assert e.value.remote_type == "AttributeError" and "'__call__'" in str(e.value)
        with pytest.raises(tensorwire.RemoteError) as e:
            w.call("_private")
        assert e.value.remote_type == "AttributeError"


# ---- the pool waits for a warm worker; replacements start in the background ---------------

def test_a_full_pool_waits_for_a_worker_instead_of_starting_one():
    with rpc.WorkerPool("interrupt_targets:Sleeper", 1, env=ENV, timeout=120.0) as pool:
        w = pool.get()
        first = w.pid
        t = time.monotonic()
        with pytest.raises(tensorwire.Timeout, match="pool of 1"):
            pool.get(timeout=0.5)
        assert 0.4 < time.monotonic() - t < 5
        # Released while another get waits: that get takes it, warm.
        threading.Timer(0.5, w.release).start()
        t = time.monotonic()
        with pool.get(timeout=60) as again:
            assert again.pid == first
            assert time.monotonic() - t >= 0.4


def test_a_killed_workers_replacement_starts_in_the_background():
    with spawn() as w:
        first = w.pid
        with pytest.raises(tensorwire.Timeout):
            w.call("sleep", 30, timeout=0.3)
        # No call made: the replacement started on its own.
        wait_for("a replacement to start", lambda: w.pid not in (None, first), within=120)
        t = time.monotonic()
        assert w.call("pid") == w.pid
        assert time.monotonic() - t < 0.5, "the call after the kill paid for a start"
