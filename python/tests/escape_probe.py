"""Hostile code for the escape suite (test_containment.py): each method of ``Probe`` tries
one attack from inside a worker and answers ``"refused: ..."`` or ``"escaped: ..."``.
Run as a script (``python escape_probe.py TARGETS_JSON``) it makes every attack itself and
prints the outcomes as JSON: that is how the same suite runs inside bubblewrap."""
from __future__ import annotations

import ctypes
import json
import os
import platform
import resource
import signal
import socket
import sys

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_X86_64 = platform.machine() == "x86_64"
# x86-64 system call numbers (the suite's kernel-surface attacks are x86-64's).
SYS = {"add_key": 248, "keyctl": 250, "bpf": 321, "perf_event_open": 298, "clone3": 435, "getpid": 39, "unshare": 272, "capget": 125}
EPERM, ESRCH, EBADF, ENOSYS = 1, 3, 9, 38


def _errno_outcome(r: int, refused_by: tuple[int, ...]) -> str:
    if r >= 0:
        return f"escaped: it returned {r}"
    e = ctypes.get_errno()
    return f"refused: {os.strerror(e)}" if e in refused_by else f"escaped: it reached the kernel ({os.strerror(e)})"


def _syscall(name_or_nr, *args) -> int:
    nr = SYS[name_or_nr] if isinstance(name_or_nr, str) else name_or_nr
    return _libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) if isinstance(a, int) else a for a in args])


def _os_outcome(fn) -> str:
    try:
        r = fn()
    except OSError as e:
        return f"refused: {e.strerror or e}"
    return f"escaped: {r!r}"[:200]


class Probe:
    def pid(self) -> int:
        return os.getpid()

    def unix_path(self, path: str) -> str:
        return _os_outcome(lambda: socket.socket(socket.AF_UNIX).connect(path))

    def unix_abstract(self, name: str) -> str:
        return _os_outcome(lambda: socket.socket(socket.AF_UNIX).connect("\0" + name))

    def tcp(self, port: int) -> str:
        return _os_outcome(lambda: socket.create_connection(("127.0.0.1", port), timeout=2))

    def signal(self, pid: int) -> str:
        return _os_outcome(lambda: os.kill(pid, signal.SIGSTOP))

    def renice(self, pid: int) -> str:
        return _os_outcome(lambda: os.setpriority(os.PRIO_PROCESS, pid, 19))

    def pin(self, pid: int) -> str:
        return _os_outcome(lambda: os.sched_setaffinity(pid, {0}))

    def prlimit(self, pid: int) -> str:
        return _os_outcome(lambda: resource.prlimit(pid, resource.RLIMIT_NOFILE, (1, 1)))

    def env(self, key: str) -> str:
        v = os.environ.get(key)
        return "refused: not set" if v is None else f"escaped: {v}"

    def fd(self, n: int) -> str:
        return _os_outcome(lambda: os.fstat(n).st_mode)

    def read(self, path: str) -> str:
        return _os_outcome(lambda: len(open(path, "rb").read()))

    def import_path(self, dirs: list) -> str:
        """Whether the host's script directory or cwd is on this worker's import path."""
        on = [d for d in dirs if d in sys.path or (d == os.getcwd() and "" in sys.path)]
        return f"escaped: {on} on sys.path" if on else "refused: not on sys.path"

    def keyring(self) -> str:
        payload = b"planted"
        r = _syscall("add_key", ctypes.c_char_p(b"user"), ctypes.c_char_p(b"tw-contain"), ctypes.c_char_p(payload), len(payload), -4)
        outcome = _errno_outcome(r, (EPERM,))
        if r >= 0:
            _syscall(SYS["keyctl"], 21, r)  # KEYCTL_INVALIDATE: a planted key does not outlive the probe
        return outcome

    def userns(self) -> str:
        return _errno_outcome(_libc.unshare(0x10000000), (EPERM,))

    def clone3(self) -> str:
        return _errno_outcome(_syscall("clone3", None, 0), (ENOSYS,))

    def bpf(self) -> str:
        return _errno_outcome(_syscall("bpf", 5, None, 0), (EPERM,))

    def perf(self) -> str:
        return _errno_outcome(_syscall("perf_event_open", None, 0, -1, -1, 0), (EPERM,))

    def x32(self) -> str:
        return _errno_outcome(_syscall(0x40000000 | SYS["getpid"]), (EPERM,))

    def setsid(self) -> str:
        return _os_outcome(os.setsid)

    def caps(self) -> str:
        bounding = 0
        for cap in range(64):
            r = _libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_READ
            if r < 0:
                break
            bounding |= r << cap
        header = (ctypes.c_uint32 * 2)(0x20080522, 0)
        data = (ctypes.c_uint32 * 6)()
        _syscall("capget", header, data)
        return "refused: no capability" if bounding == 0 and not any(data) else f"escaped: bounding {bounding:#x}, sets {list(data)}"

    def escapee(self, name: str) -> str:
        """A grandchild in a session of its own, named ``name`` (the host looks for it)."""
        pid = os.fork()
        if pid == 0:
            try:
                os.setsid()
            except OSError:
                pass
            if os.fork() == 0:
                _libc.prctl(15, ctypes.c_char_p(name.encode()), 0, 0, 0)  # PR_SET_NAME
                while True:
                    signal.pause()
            os._exit(0)
        os.waitpid(pid, 0)
        return "started"

    def sleep(self, seconds: float) -> None:
        import time

        time.sleep(seconds)

    def exit(self) -> None:
        os._exit(0)


def attacks(t: dict) -> list[tuple[str, str, list]]:
    """(what, method, args) of every attack against the targets ``t`` (see the test)."""
    return [
        ("unix socket by path", "unix_path", [t["path"]]),
        ("unix socket by abstract name", "unix_abstract", [t["abstract"]]),
        ("tcp to the host", "tcp", [t["port"]]),
        ("SIGSTOP another process", "signal", [t["victim"]]),
        ("re-nice another process", "renice", [t["victim"]]),
        ("pin another process", "pin", [t["victim"]]),
        ("prlimit another process", "prlimit", [t["victim"]]),
        ("the host's environment", "env", [t["secret"]]),
        ("an inherited fd", "fd", [t["fd"]]),
        ("a file beside the host", "read", [t["beside"]]),
        ("a host file", "read", ["/etc/hostname"]),
        ("the host's dirs on the import path", "import_path", [t["dirs"]]),
        ("the user keyring", "keyring", []),
        ("a user namespace", "userns", []),
        ("clone3", "clone3", []),
        ("bpf", "bpf", []),
        ("perf_event_open", "perf", []),
        ("an x32 system call", "x32", []),
        ("setsid", "setsid", []),
        ("capabilities", "caps", []),
    ]


if __name__ == "__main__":
    targets = json.loads(sys.argv[1])
    p = Probe()
    print(json.dumps({what: getattr(p, m)(*args) for what, m, args in attacks(targets)}))
