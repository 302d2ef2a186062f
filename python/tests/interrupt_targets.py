"""Objects the workers of test_interrupt.py serve (``python -m tensorwire.worker
interrupt_targets:<name>``): imported in the worker process only."""
from __future__ import annotations

import os
import time


class Sleeper:
    def sleep(self, seconds):
        time.sleep(seconds)
        return seconds

    def pid(self):
        return os.getpid()


class Scaled:
    """A class target with constructor arguments (``spawn(init_args=..., init_kwargs=...)``)."""

    def __init__(self, k, *, offset=0):
        self.k, self.offset = k, offset

    def apply(self, x):
        return x * self.k + self.offset


def double(x, plus=0):
    """A function target: called as ``w(x)``."""
    return 2 * x + plus
