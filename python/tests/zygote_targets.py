"""Targets for test_zygote.py. Importing this module appends the importing process's pid
to the file ``ZYGOTE_MARKER`` names: which process imported the target (the zygote, or
the worker itself) is on record."""
from __future__ import annotations

import os
import sys

_marker = os.environ.get("ZYGOTE_MARKER")
if _marker:
    with open(_marker, "a") as f:
        f.write(f"{os.getpid()}\n")


class Plugin:
    def add(self, a, b):
        return a + b

    def scale(self, t, k=2.0):
        return t * k

    def pid(self):
        return os.getpid()

    def ppid(self):
        return os.getppid()

    def say(self, text):
        print(text, flush=True)
        print(f"err:{text}", file=sys.stderr, flush=True)
        return True

    def torch_imported(self):
        return "torch" in sys.modules

    def crash(self):
        os._exit(7)

    def hold_gil(self, seconds):
        # libc's sleep through PyDLL keeps the GIL: the worker cannot notice its
        # connection closing, only a signal ends it.
        import ctypes

        ctypes.PyDLL(None).sleep(int(seconds))
