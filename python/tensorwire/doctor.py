"""``python -m tensorwire doctor``: one line per capability tensorwire uses, ✓ or ✗, and
what to do about a ✗. Exits non-zero if a CPU capability (the ones every connection
needs) is missing; CUDA lines are informational on machines without a GPU."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

import tensorwire

_CHILD = r"""
import sys, tensorwire, torch
with tensorwire.from_fd(int(sys.argv[1])) as c:
    t = c.ring_recv(timeout=20)
    c.ring_send(t + 1)
"""


@dataclass
class Check:
    """One line of the report."""
    name: str
    ok: bool
    detail: str
    fix: str = ""
    required: bool = True

    def line(self) -> str:
        mark = "✓" if self.ok else "✗"
        text = f"{mark} {self.name}: {self.detail}"
        if not self.ok and self.fix:
            text += f" — {self.fix}"
        return text


def _guard(name: str, fn: Callable[[], Check], required: bool = True) -> Check:
    try:
        c = fn()
    except Exception as e:  # a check that blows up is a failed check, with its reason
        c = Check(name, False, f"{type(e).__name__}: {e}".splitlines()[0], "see the message")
    c.required = required and c.required
    return c


def check_memfd() -> Check:
    t = tensorwire.empty(4096, dtype=torch.uint8)
    ok = tensorwire.is_shared(t)
    return Check("memfd + seals", ok, "sealed memfd segments work" if ok else "segment not created",
                 "needs Linux >= 3.17 with memfd_create and file seals (not blocked by seccomp)")


def check_dev_shm() -> Check:
    try:
        st = os.statvfs("/dev/shm")
    except OSError as e:
        return Check("/dev/shm", False, f"not available ({e.strerror})",
                     "tensorwire itself uses memfd, but torch.multiprocessing interop and named segments need /dev/shm",
                     required=False)
    size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    ok = size >= 1 << 30
    return Check("/dev/shm size", ok, f"{size / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free",
                 "small /dev/shm (a container default is 64 MiB) limits torch.multiprocessing and named "
                 "segments: run the container with --shm-size=8g (memfd segments count against the same tmpfs "
                 "limit only in memory cgroups)", required=False)


def check_two_process() -> list[Check]:
    """Handshake (SCM_CREDENTIALS), a ring round trip (futex doorbells) and peer death
    (pidfd / EOF) with a real child process."""
    a, b = tensorwire.socketpair()
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(b)], pass_fds=[b])
    os.close(b)
    out: list[Check] = []
    try:
        conn = tensorwire.from_fd(a)
    except tensorwire.Error as e:
        proc.kill()
        proc.wait()
        return [Check("SCM_CREDENTIALS", False, f"handshake failed: {e}",
                      "the kernel must pass credentials on Unix sockets (SO_PASSCRED)")]
    with conn:
        pid_ok = conn.peer_pid == proc.pid
        out.append(Check("SCM_CREDENTIALS", pid_ok, f"handshake with a child: peer pid {conn.peer_pid}"
                         + ("" if pid_ok else f", expected {proc.pid}"),
                         "in another pid namespace the peer pid is translated; run both ends in one namespace"))
        try:
            conn.ring_send(torch.arange(4), timeout=20)
            back = conn.ring_recv(timeout=20)
            ok = torch.equal(back, torch.arange(4) + 1)
            out.append(Check("futex doorbells", ok, "ring round trip with a sleeping peer" if ok else "wrong data",
                             "futex(2) on shared memory must work (not blocked by seccomp)"))
        except tensorwire.Error as e:
            out.append(Check("futex doorbells", False, str(e), "futex(2) on shared memory must work"))
        proc.wait(20)
        t0 = time.perf_counter()
        try:
            conn.recv(timeout=5)
            out.append(Check("peer death", False, "recv after the child exited did not fail", "report this"))
        except tensorwire.PeerGone:
            dt = time.perf_counter() - t0
            out.append(Check("peer death", True, f"child exit seen in {dt * 1e3:.1f} ms"))
        except tensorwire.Timeout:
            out.append(Check("peer death", False, "child exit not seen within 5 s", "needs pidfd or socket EOF"))
    return out


def check_pidfd() -> Check:
    fd = os.pidfd_open(os.getpid())
    os.close(fd)
    return Check("pidfd", True, "pidfd_open works (peer death seen at once, also for a peer that leaked its socket)")


def check_cuda() -> list[Check]:
    out: list[Check] = []
    built = tensorwire.cuda_built()
    try:
        n = tensorwire.cuda_device_count()
        out.append(Check("CUDA driver + devices", n > 0, f"{n} device(s)" + ("" if built else
                         "; but this build has no CUDA backend"),
                         "install the NVIDIA driver", required=False))
    except tensorwire.Error as e:
        msg = str(e).split(": ", 1)[-1]
        out.append(Check("CUDA driver + devices", False, msg.splitlines()[0],
                         "CPU tensors work; for CUDA tensors install the NVIDIA driver on a GPU machine",
                         required=False))
        n = 0
    if not built:
        out.append(Check("CUDA backend in this build", False, "built without a CUDA toolkit",
                         "reinstall with a CUDA toolkit (nvcc) present: pip install --no-build-isolation .",
                         required=False))
    out.append(_legacy_ipc(n))
    out.append(_expandable_segments())
    return out


def _legacy_ipc(devices: int) -> Check:
    name = "legacy-IPC-capable allocations"
    if devices == 0 or not torch.cuda.is_available():
        return Check(name, False, "no CUDA device to allocate on", "needs a GPU", required=False)
    t = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    cuda = ctypes.CDLL("libcuda.so.1")
    value = ctypes.c_int(0)
    CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = 19
    r = cuda.cuPointerGetAttribute(ctypes.byref(value), CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
                                   ctypes.c_uint64(t.data_ptr()))
    if r != 0:
        return Check(name, False, f"cuPointerGetAttribute failed ({r})", "update the NVIDIA driver", required=False)
    ok = bool(value.value)
    return Check(name, ok, "torch's allocations can be shared by IPC handle" if ok else
                 "torch's allocations are not legacy-IPC capable",
                 "tensorwire then shares them by VMM fd (expandable segments) or you copy through the GPU ring",
                 required=False)


def _expandable_segments() -> Check:
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," + os.environ.get("PYTORCH_ALLOC_CONF", "")
    on = "expandable_segments:true" in conf.replace(" ", "").lower()
    return Check("expandable segments", True,
                 "on: CUDA tensors are shared by VMM fd, also with a sandboxed GPU worker" if on else
                 "off (PYTORCH_CUDA_ALLOC_CONF): CUDA tensors are shared by IPC handle; a sandboxed GPU worker "
                 "(its own pid namespace, which IPC handles do not cross) gets a device copy", required=False)


def check_torch_version() -> Check:
    """This torch against the range the wheel was built and tested for (the C++ extension,
    when ``TENSORWIRE_TORCH_LIB`` selects it, is built for one torch: loading it proved it)."""
    from . import _torch_check

    info = tensorwire.build_info()
    if info["backend"] == "torch-lib":
        return Check("torch version", True, f"torch {torch.__version__}; C++ extension {info['library']} loaded")
    p = _torch_check.problem(torch.__version__, info)
    rng = f">= {info['torch_min']}, < {info['torch_below']}"
    if p is None:
        return Check("torch version", True, f"torch {torch.__version__}, in the wheel's range ({rng})")
    kind, msg = p
    return Check("torch version", kind == "new", msg, f"pip install 'torch>={info['torch_min']},<{info['torch_below']}'")


def check_containment() -> list[Check]:
    """What a sandboxed worker (``tensorwire.rpc.Sandbox``) gets on this machine; a level
    missing here makes ``spawn(sandbox=...)`` fail, naming it (never a weaker worker)."""
    from . import _native

    c = _native.containment()
    abi = c["landlock_abi"]
    return [
        Check("sandbox: namespaces", c["user_namespaces"],
              "a worker gets its own user, pid, network, IPC, UTS and cgroup namespaces" if c["user_namespaces"]
              else f"user namespaces refused: {c['user_namespaces_why']}",
              "allow unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1, or "
              "kernel.apparmor_restrict_unprivileged_userns=0), or run sandboxed workers with Sandbox(namespaces=False)",
              required=False),
        Check("sandbox: landlock", abi > 0,
              f"ABI {abi}: file-system allow-list" + (", TCP" if abi >= 4 else "") + (", device ioctls" if abi >= 5 else "")
              + (", abstract-socket and signal scopes" if abi >= 6 else " (no abstract-socket or signal scopes before ABI 6)")
              if abi else "not available",
              "Linux >= 5.13 with landlock in the lsm= boot list", required=False),
        Check("sandbox: seccomp", c["seccomp"], "filter mode available" if c["seccomp"] else "no seccomp filter mode",
              "a kernel with CONFIG_SECCOMP_FILTER", required=False),
    ]


def run() -> list[Check]:
    """Every check, in report order."""
    checks = [_guard("torch version", check_torch_version), _guard("memfd + seals", check_memfd),
              _guard("/dev/shm size", check_dev_shm, required=False), _guard("pidfd", check_pidfd)]
    try:
        checks += check_two_process()
    except Exception as e:
        checks.append(Check("two processes", False, f"{type(e).__name__}: {e}", "see the message"))
    try:
        checks += check_containment()
    except Exception as e:
        checks.append(Check("sandbox", False, f"{type(e).__name__}: {e}", "see the message", required=False))
    try:
        checks += check_cuda()
    except Exception as e:
        checks.append(Check("CUDA", False, f"{type(e).__name__}: {e}", "see the message", required=False))
    return checks


def main(argv: Optional[list[str]] = None) -> int:
    """Print the report; exit status 1 if a required (CPU) capability is missing."""
    if argv:
        print("usage: python -m tensorwire doctor", file=sys.stderr)
        return 2
    checks = run()
    print(f"tensorwire doctor: torch {torch.__version__}, python {sys.version.split()[0]}, "
          f"library {tensorwire.library_path()}")
    for c in checks:
        print(c.line())
    missing = [c.name for c in checks if c.required and not c.ok]
    print("doctor: " + ("everything tensorwire needs for CPU tensors is here" if not missing
                        else "missing: " + ", ".join(missing)))
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
