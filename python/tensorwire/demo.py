"""``python -m tensorwire demo``: two processes share tensors both ways through torch.

The parent starts a child (``python -m tensorwire.demo --child FD``) over a
:func:`tensorwire.socketpair`. For each size and layout (contiguous, transposed,
strided slice, stride-0 expand) a tensor goes parent -> child and another child ->
parent under a lease. The receiver checks the view's elements against the sender's
(a checksum sent back), then flips a byte of the shared storage; the sender must see the
flip in its own tensor, which proves the bytes were never copied. Exits non-zero if any
check failed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from typing import Callable, Optional

import torch

import tensorwire

SIZES = [4 << 10, 1 << 20, 64 << 20]
STOP = 1 << 40

LAYOUTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "contiguous": lambda t: t,
    "transposed": lambda t: t.t(),
    "strided slice": lambda t: t[::2, 1::3],
    "expand (stride 0)": lambda t: t[0:1].expand(4, t.shape[1]),
}


def _checksum(t: torch.Tensor) -> int:
    """Sum of the view's elements, as exact int64 (the tensors hold small integers)."""
    return int(t.to(torch.int64).sum().item())


def _source(nbytes: int, seed: int) -> torch.Tensor:
    """A [rows, 256] int32 tensor of ``nbytes`` in a tensorwire segment, filled with a
    pattern that differs per seed."""
    rows = max(nbytes // (256 * 4), 4)
    t = tensorwire.empty(rows, 256, dtype=torch.int32)
    t.copy_(torch.arange(rows * 256, dtype=torch.int32).view(rows, 256) % 1000 + seed)
    return t


def _receive_and_flip(conn: tensorwire.Connection) -> Optional[int]:
    """Receive one view, send its checksum back, flip bit 0 of its first element's byte
    in the shared storage; None on STOP."""
    t, tag = conn.recv_tagged(timeout=60)
    if tag == STOP:
        return None
    total = _checksum(t)
    byte = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
    byte[t.storage_offset() * t.element_size()] ^= 1
    del byte, t  # the lease is released once the last view is gone
    conn.send(torch.tensor([total], dtype=torch.int64), tag)
    return total


def _send_and_check(conn: tensorwire.Connection, src: torch.Tensor, view: torch.Tensor, tag: int) -> tuple[bool, bool, float]:
    """Send ``view``, wait for the checksum, and see whether the peer's flip landed in
    ``src``: (checksum ok, zero-copy, seconds for send + reply)."""
    before = src.view(torch.uint8).reshape(-1)[view.storage_offset() * 4].item()
    t0 = time.perf_counter()
    zero_copy_export = conn.send(view, tag)
    reply = conn.recv(timeout=60)
    dt = time.perf_counter() - t0
    after = src.view(torch.uint8).reshape(-1)[view.storage_offset() * 4].item()
    flipped = after == (int(before) ^ 1)
    src.view(torch.uint8).reshape(-1)[view.storage_offset() * 4] = before  # put it back
    return int(reply.item()) == _checksum(view), bool(zero_copy_export and flipped), dt


def child(fd: int, sizes: list[int]) -> int:
    """The child's side: receive and flip until STOP, then send its own tensors."""
    with tensorwire.from_fd(fd) as conn:
        while _receive_and_flip(conn) is not None:
            pass
        failed = 0
        for size in sizes:
            src = _source(size, seed=7)
            for i, layout in enumerate(LAYOUTS.values()):
                ok, zc, _ = _send_and_check(conn, src, layout(src), i)
                failed += (not ok) + (not zc)
        conn.send(tensorwire.zeros(1), STOP)
        # Wait until the parent has taken STOP (a ring copy: no lease) before closing,
        # since closing ends the leases of whatever this side sent.
        conn.ring_recv(timeout=60)
    return 1 if failed else 0


def main(argv: Optional[list[str]] = None) -> int:
    """Run the demo; returns the exit status (non-zero if any check failed)."""
    ap = argparse.ArgumentParser(prog="python -m tensorwire demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-size", type=int, default=64 << 20, help="largest tensor in bytes (default 64 MiB)")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    sizes = [s for s in SIZES if s <= args.max_size] or [SIZES[0]]
    if args.child is not None:
        return child(args.child, sizes)

    parent_fd, child_fd = tensorwire.socketpair()
    proc = subprocess.Popen([sys.executable, "-m", "tensorwire.demo", "--child", str(child_fd),
                             "--max-size", str(args.max_size)], pass_fds=[child_fd])
    os.close(child_fd)
    rows: list[tuple[str, str, str, bool, bool, float]] = []
    with tensorwire.from_fd(parent_fd) as conn:
        for size in sizes:
            src = _source(size, seed=3)
            for i, (name, layout) in enumerate(LAYOUTS.items()):
                ok, zc, dt = _send_and_check(conn, src, layout(src), i)
                rows.append(("parent -> child", _human(size), name, ok, zc, dt))
        conn.send(tensorwire.zeros(1), STOP)
        for size in sizes:
            for name in LAYOUTS:
                t0 = time.perf_counter()
                _receive_and_flip(conn)
                rows.append(("child -> parent", _human(size), name, True, True, time.perf_counter() - t0))
        _receive_and_flip(conn)  # the child's STOP
        conn.ring_send(torch.zeros(1))  # "taken": the child may close now
        child_rc = proc.wait(60)  # before closing: closing would end the child's view of our leases

    print(f"tensorwire demo: torch {torch.__version__}, parent pid {os.getpid()}, child pid {proc.pid}")
    print(f"{'direction':<16} {'size':>7}  {'layout':<18} {'checksum':<9} {'zero-copy':<9} {'send+verify':>11}")
    for direction, size_s, name, ok, zc, dt in rows:
        if direction == "child -> parent":
            ok_s, zc_s = "(child)", "(child)"
        else:
            ok_s, zc_s = ("ok" if ok else "WRONG"), ("yes" if zc else "NO")
        print(f"{direction:<16} {size_s:>7}  {name:<18} {ok_s:<9} {zc_s:<9} {dt * 1e6:9.0f} us")
    failed = sum((not ok) + (not zc) for d, _, _, ok, zc, _ in rows if d == "parent -> child")
    print(f"child -> parent checks (checksum, the parent's flip seen in the child's tensor) ran in the child: "
          f"{'all passed' if child_rc == 0 else 'FAILED'}")
    good = failed == 0 and child_rc == 0
    print("demo: " + ("OK — every view arrived intact, zero-copy, both ways" if good else "FAILED"))
    return 0 if good else 1


def _human(n: int) -> str:
    for unit, s in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= s:
            return f"{n // s} {unit}"
    return f"{n} B"


if __name__ == "__main__":
    sys.exit(main())
