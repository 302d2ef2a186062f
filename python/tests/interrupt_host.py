"""A host process for test_interrupt.py: makes a call that would block for 30 s, which
the test interrupts with SIGINT; prints when it caught KeyboardInterrupt (CLOCK_MONOTONIC)
and what the worker (or connection) looked like after, as one JSON line.

    python interrupt_host.py kill|abandon|endpoint|pending|spawn
"""
from __future__ import annotations

import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import tensorwire.rpc as rpc  # noqa: E402
from support import gone  # noqa: E402


class Slow:
    def sleep(self, seconds):
        time.sleep(seconds)
        return seconds


def main(mode: str) -> None:
    report: dict = {"mode": mode}
    if mode == "spawn":
        blocking = lambda: rpc.spawn("interrupt_slow_import:Never", env={"PYTHONPATH": HERE})  # noqa: E731
    elif mode in ("kill", "abandon"):
        w = rpc.spawn("interrupt_targets:Sleeper", env={"PYTHONPATH": HERE}, on_interrupt=mode)
        before = w.call("pid")
        blocking = lambda: w.call("sleep", 30)  # noqa: E731 - no deadline
    else:
        a, b = rpc.pair(serve_b={"slow": Slow()})
        if mode == "endpoint":
            blocking = lambda: a.call("slow", "sleep", 30)  # noqa: E731
        else:
            blocking = lambda: a.start("slow", "sleep", 30).result()  # noqa: E731
    print("CALLING", flush=True)
    try:
        blocking()
        report["interrupted_at"] = None
    except KeyboardInterrupt:
        report["interrupted_at"] = time.monotonic()
    if mode in ("kill", "abandon"):
        report["before"] = before
        if mode == "kill":
            by = time.monotonic() + 10
            while not gone(before) and time.monotonic() < by:
                time.sleep(0.01)
        report["before_gone"] = gone(before)
        report["after"] = w.call("pid", timeout=120)
        w.close()
    elif mode != "spawn":
        report["pending_calls"] = a._native.pending_calls
        report["after"] = a.call("slow", "sleep", 0, timeout=30)
    print("REPORT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
    # Not waiting for an abandoned handler still sleeping on the connection's threads.
    os._exit(0)
