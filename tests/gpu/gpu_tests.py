#!/usr/bin/env python3
"""GPU tests of the tensorwire torch extension: two real processes sharing CUDA tensors
through torch.ops.tensorwire (CUDA IPC). Plain Python (pytest is not needed on the GPU
machine); run by scripts/gpu_test.sh:

    PYTHONPATH=python TENSORWIRE_TORCH_LIB=build/torch-ext/libtensorwire_torch.so python3 tests/gpu/gpu_tests.py [NAME...]

Each test prints PASS or FAIL; the exit status is non-zero if any failed. Without a CUDA
device every test is reported SKIPPED and the exit status is 2 (never a silent pass).

  dtypes_and_views   every dtype, contiguous and non-contiguous views: the consumer sees
                     the producer's storage bytes and exact layout (sizes, strides, offset)
  zero_copy          the consumer's in-place write is seen by the producer (same memory)
  ordering           a kernel queued right before `send` (after a long GPU sleep), no
                     synchronize: the consumer still reads its result (IPC event wait)
  sigkill            leases held by a consumer that is SIGKILLed are reclaimed, and the
                     storages' reference counts return to what they were
  handle_cache       the consumer's IPC handle cache (cuda_ipc_cache_stats; each release
                     flushed by a stream synchronize + stats()): at keep_warm(16) one tensor
                     sent many times opens its handle once; at keep_warm(0) (the default)
                     once per message, leaving no handle open; and even at keep_warm(0) a
                     message of an allocation whose import is still alive reuses its handle
  gpu_ring           the GPU bounce ring (ring_send / cuda_ring_recv, 64 KiB slots): every
                     dtype and view arrives as the packed bytes of the view; a 3 MiB tensor
                     goes through in 48 chunks (the 4 slots wrap 12 times); ordering by a
                     GPU sleep + fill right before ring_send, no synchronize; the consumer
                     opens one IPC handle (the arena, at connection setup), none per message
  vmm                a producer whose allocator uses expandable segments (VMM memory, which
                     legacy IPC cannot share): send exports by fd, the consumer reads the
                     values and its in-place write is seen by the producer (zero-copy), and
                     its IPC handle cache opened nothing (not legacy IPC by accident)
  forward            host -> relay -> last: the relay sends a view of what it received on
                     (`send(u[1:])`, zero-copy) after writing into it, opening no IPC handle
                     for the forward; the host's write was queued behind a GPU sleep right
                     before its send (no synchronize): the last reads it and the relay's
                     write; the last's write lands in the host's tensor; the host's lease
                     lives while the last holds the tensor and comes back when it drops it

A test that cannot run on this machine prints a line starting with "SKIPPED <name>:"
(scripts/gpu_test.sh greps for those).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
try:  # the installed package (scripts/gpu_test.sh: the wheel), else the checkout's
    import tensorwire  # noqa: F401
except ImportError:
    sys.path.insert(0, str(ROOT / "python"))

import torch  # noqa: E402

import tensorwire  # noqa: E402

sys.path.insert(0, str(ROOT / "python" / "tests"))
from support import sleep_cycles_for, views_of, wait_stats  # noqa: E402

STOP = 999_999
SET_KEEP_WARM = 999_998  # control message to the child: payload n
REPORT = 999_997         # control message: reply with the child's IPC cache stats
RING_ECHO = 999_996      # control message: payload n: echo the next n GPU ring messages
RING_MINMAX = 999_995    # control message: payload n: min/max of the next n GPU ring messages
VMM_NO_FD = 999_994      # from the VMM producer: its allocator's memory cannot be exported by fd
HOLD = 999_993           # control message to the child: keep the next tensor alive (until DROP_HELD)
DROP_HELD = 999_992      # control message: drop the held tensors and flush their release
TAKE = 999_991           # forward test, to the last: take the relay's tensor, report, keep it
RELEASE = 999_990        # forward test, to the last: drop the tensor and flush its release

DTYPES = [
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.float32,
    torch.float64, torch.complex32, torch.complex64, torch.complex128, torch.bool, torch.bfloat16,
    torch.float8_e5m2, torch.float8_e4m3fn, torch.float8_e5m2fnuz, torch.float8_e4m3fnuz,
    torch.uint16, torch.uint32, torch.uint64,
]
if hasattr(torch, "float8_e8m0fnu"):
    DTYPES.append(torch.float8_e8m0fnu)


def storage_bytes(t):
    """The whole storage of `t` as a uint8 tensor on its device (no dtype-specific kernels)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def meta_of(t):
    return [t.element_size(), t.storage_offset(), t.untyped_storage().nbytes(), t.get_device(), t.dim(),
            *t.shape, *t.stride()]


def ack(conn, tag, values=(0,)):
    conn.send(tensorwire.to_shared(torch.tensor(list(values), dtype=torch.int64)), tag)


# --- the consumer process ----------------------------------------------------------------

def flush_releases(conn):
    """Release this process's dropped CUDA imports now: their deleters recorded a mark on
    the current stream (released by the reaper once reached); after a synchronize the
    marks are reached, and stats() runs a reap pass that releases them (and closes their
    IPC handles if the cache does not keep them)."""
    torch.cuda.current_stream().synchronize()
    conn.stats()


def child_main(mode, fd):
    conn = tensorwire.from_fd(fd)
    held = []  # tensors kept alive on HOLD
    hold_next = False
    while True:
        t, tag = conn.recv_tagged(timeout=120)
        if tag == STOP:
            break
        if tag == SET_KEEP_WARM:
            tensorwire.cuda_ipc_cache_keep_warm(int(t.item()))
            del t
            ack(conn, tag)
            continue
        if tag == REPORT:
            del t
            s = tensorwire.cuda_ipc_cache_stats()
            ack(conn, tag, [s["opens"], s["open_handles"]])
            continue
        if tag == HOLD:
            del t
            hold_next = True
            ack(conn, tag)
            continue
        if tag == DROP_HELD:
            del t
            held.clear()
            flush_releases(conn)
            ack(conn, tag)
            continue
        if hold_next:
            hold_next = False
            held.append(t)
            del t
            ack(conn, tag)
            continue
        if tag in (RING_ECHO, RING_MINMAX):
            for _ in range(int(t.item())):
                u, utag = conn.cuda_ring_recv_tagged(timeout=120)
                if tag == RING_MINMAX:
                    # Read on the current stream (it waited for the producer's event): no sync.
                    lo, hi = u.min().item(), u.max().item()
                    conn.send(tensorwire.to_shared(torch.tensor([lo, hi], dtype=torch.float64)), utag)
                else:
                    ack(conn, utag, [u.element_size(), *u.shape, *u.stride(), int(u.is_cuda)])
                    conn.send(tensorwire.to_shared(storage_bytes(u).cpu()), utag)
            del t
            continue
        if mode == "echo":
            # Flip bit 0 of the view's first byte in the shared memory, then reply with the
            # layout and a copy of the storage bytes as this process sees them.
            assert t.is_cuda, t.device
            s = storage_bytes(t)
            if t.numel() > 0:
                off = t.storage_offset() * t.element_size()
                s[off : off + 1].bitwise_xor_(1)
            copy = s.cpu()  # synchronizes the current stream: the flip is done
            meta = meta_of(t)
            del t, s
            ack(conn, tag, meta)
            conn.send(tensorwire.to_shared(copy), tag)
        elif mode == "scale":
            t.mul_(2)
            torch.cuda.current_stream().synchronize()
            del t
            ack(conn, tag)
        elif mode == "minmax":
            # Read on the current stream (which waited for the producer's event): no sync.
            lo, hi = t.min().item(), t.max().item()
            del t
            conn.send(tensorwire.to_shared(torch.tensor([lo, hi], dtype=torch.float64)), tag)
        elif mode == "hold":
            held = [t] + [conn.recv(timeout=120) for _ in range(tag - 1)]
            ack(conn, tag, [len(held)])
            while True:
                time.sleep(60)
        elif mode == "drop":
            del t
            flush_releases(conn)  # released (and its handle closed if not kept warm) before the ack
            ack(conn, tag)
        elif mode == "vmm_check":
            # The producer's values arrived; write -1 into its memory and report.
            ok = bool(torch.equal(t.cpu(), torch.arange(t.numel(), dtype=t.dtype) * 3))
            t[0] = -1
            torch.cuda.current_stream().synchronize()
            del t
            ack(conn, tag, [int(ok)])
        else:
            raise SystemExit(f"unknown mode {mode}")
    conn.close()


# --- the producer side -------------------------------------------------------------------

class Child:
    def __init__(self, mode, **limits):
        parent_fd, child_fd = tensorwire.socketpair()
        self.proc = subprocess.Popen([sys.executable, __file__, "--child", mode, str(child_fd)], pass_fds=[child_fd])
        os.close(child_fd)
        self.conn = tensorwire.from_fd(parent_fd, **limits)

    def recv(self, tag=None):
        t, got = self.conn.recv_tagged(timeout=120)
        if tag is not None:
            check(got == tag, f"reply tag {got}, expected {tag}")
        return t

    def control(self, tag, value=0):
        self.conn.send(tensorwire.to_shared(torch.tensor([value])), tag)
        return self.recv(tag).tolist()

    def finish(self):
        self.conn.send(tensorwire.zeros(1), STOP)
        rc = self.proc.wait(timeout=120)
        self.conn.close()
        check(rc == 0, f"child exited with {rc}")

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.conn.close()


class Failed(Exception):
    pass


class Skipped(Exception):
    """This machine cannot run the test (said loudly, never counted as a pass)."""


def check(cond, what):
    if not cond:
        raise Failed(what)


def random_cuda(shape, dtype):
    t = torch.empty(shape, dtype=dtype, device="cuda")
    s = storage_bytes(t)
    s.copy_(torch.randint(0, 2 if dtype == torch.bool else 256, s.shape, dtype=torch.uint8))
    return t


def test_dtypes_and_views():
    c = Child("echo")
    try:
        tag = 0
        for dtype in DTYPES:
            base = random_cuda((6, 8), dtype)
            for name, t in views_of(base).items():
                tag += 1
                what = f"{dtype} {name}"
                before = storage_bytes(t).cpu()
                expected = before.clone()
                if t.numel() > 0:
                    expected[t.storage_offset() * t.element_size()] ^= 1
                check(c.conn.send(t, tag) is True, f"{what}: send was not zero-copy")
                meta = c.recv(tag).tolist()
                copy = c.recv(tag)
                check(meta == meta_of(t), f"{what}: consumer saw layout {meta}, sent {meta_of(t)}")
                check(torch.equal(copy, expected), f"{what}: consumer's storage bytes differ from the producer's")
                after = storage_bytes(t).cpu()
                check(torch.equal(after, expected), f"{what}: the consumer's write is not in the producer's memory")
                s = wait_stats(c.conn, lambda s: s["live_leases"] == 0)
                check(s["live_leases"] == 0 and s["live_bytes"] == 0, f"{what}: lease not released: {s}")
        # A tensor with no storage bytes at all still arrives (on the device, with its shape).
        tag += 1
        e = torch.empty(0, 3, device="cuda")
        check(c.conn.send(e, tag) is False, "empty tensor: expected a (non-zero-copy) holder export")
        meta = c.recv(tag).tolist()
        c.recv(tag)
        check(meta[3] == e.get_device() and meta[4:] == [2, 0, 3, *e.stride()], f"empty tensor: {meta}")
        s = wait_stats(c.conn, lambda s: s["live_leases"] == 0)
        check(s["granted"] == s["released"] == tag, f"stats {s}")
        c.finish()
        return f"{len(DTYPES)} dtypes x {len(views_of(torch.empty(6, 8)))} views + empty"
    finally:
        c.kill()


def test_zero_copy():
    c = Child("scale")
    try:
        t = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
        v = t[7::3]
        expected = t.clone()
        expected[7::3] *= 2
        c.conn.send(v, 1)
        c.recv(1)
        check(torch.equal(t, expected), "the consumer's in-place mul_ is not visible to the producer")
        c.finish()
    finally:
        c.kill()


def test_ordering():
    c = Child("minmax")
    try:
        cycles = sleep_cycles_for(200)
        t = torch.zeros(8 << 20, device="cuda")  # 32 MiB
        for i in range(1, 6):
            torch.cuda.synchronize()
            torch.cuda._sleep(cycles)  # the stream is busy ~200 ms ...
            t.fill_(float(i))          # ... then writes i, queued before the send
            c.conn.send(t, i)          # no synchronize: the IPC event orders the consumer
            busy = not torch.cuda.current_stream().query()
            check(busy, "the fill finished before send returned: sleep too short to prove ordering")
            lo, hi = c.recv(i).tolist()
            check(lo == hi == float(i), f"round {i}: consumer read min {lo}, max {hi}; expected {float(i)}")
        c.finish()
    finally:
        c.kill()


def test_sigkill():
    c = Child("hold")
    try:
        n = 20
        tensors = [torch.randn(256, 256, device="cuda") for _ in range(n)]
        uses = [torch._C._storage_Use_Count(t.untyped_storage()._cdata) for t in tensors]
        for i, t in enumerate(tensors):
            c.conn.send(t[i % 7:], n)  # tag n: the child holds n tensors
        check(c.recv(n).tolist() == [n], "child did not hold the tensors")
        s = c.conn.stats()
        check(s["live_leases"] == n and s["live_bytes"] == n * 256 * 256 * 4, f"before kill: {s}")
        check([torch._C._storage_Use_Count(t.untyped_storage()._cdata) for t in tensors] == [u + 1 for u in uses],
              "each lease should own one reference to its storage")
        os.kill(c.proc.pid, signal.SIGKILL)
        c.proc.wait()
        s = wait_stats(c.conn, lambda s: s["live_leases"] == 0)
        check(s["live_leases"] == 0 and s["live_bytes"] == 0 and s["reclaimed"] == n, f"after kill: {s}")
        check([torch._C._storage_Use_Count(t.untyped_storage()._cdata) for t in tensors] == uses,
              "storage references not dropped after reclaim")
        try:
            c.conn.send(tensors[0])
            check(False, "send to a dead peer succeeded")
        except RuntimeError as e:
            check("TW_ERR_PEER_GONE" in str(e), f"unexpected error: {e}")
    finally:
        c.kill()


def test_handle_cache():
    c = Child("drop")  # the child drops each tensor and flushes its release before acking
    try:
        t = torch.ones(1 << 20, device="cuda")  # 4 MiB: one allocation, one IPC handle
        k = 50

        def send_k():
            for i in range(k):
                c.conn.send(t, i + 1)
                c.recv(i + 1)

        # keep_warm(16): the handle stays open between messages, opened once for all k.
        c.control(SET_KEEP_WARM, 16)
        opens0, _ = c.control(REPORT)
        send_k()
        opens1, open_handles = c.control(REPORT)
        check(opens1 - opens0 == 1,
              f"keep_warm(16): {opens1 - opens0} cuIpcOpenMemHandle calls for {k} messages of one tensor, expected 1")
        check(open_handles == 1,
              f"keep_warm(16): {open_handles} handle(s) open after the releases, expected 1 (kept warm)")

        # keep_warm(0) (the default; set explicitly): setting it closes the idle warm
        # handle at once, and every message opens the handle and its release closes it.
        c.control(SET_KEEP_WARM, 0)
        opens2, open_handles = c.control(REPORT)
        check(open_handles == 0, f"keep_warm(0): {open_handles} idle handle(s) still open right after setting it")
        send_k()
        opens3, open_handles = c.control(REPORT)
        check(opens3 - opens2 == k, f"keep_warm(0): {opens3 - opens2} opens for {k} messages, expected {k}")
        check(open_handles == 0, f"keep_warm(0): {open_handles} handle(s) still open after every import was released")

        # Ref-counted even at keep_warm(0): while one import of the allocation is alive, a
        # second message of it reuses the open handle.
        c.control(HOLD)
        c.conn.send(t, 1)       # held by the child
        c.recv(1)
        opens4, open_handles = c.control(REPORT)
        check(opens4 - opens3 == 1 and open_handles == 1,
              f"held import: {opens4 - opens3} open(s), {open_handles} handle(s) open; expected 1 and 1")
        c.conn.send(t[1:], 2)   # another view of the same allocation, dropped (and flushed)
        c.recv(2)
        opens5, open_handles = c.control(REPORT)
        check(opens5 == opens4,
              f"keep_warm(0), import alive: a second message of the allocation opened {opens5 - opens4} handle(s), "
              "expected 0 (reuse of the open handle)")
        check(open_handles == 1, f"keep_warm(0), import alive: {open_handles} handle(s) open after the second "
              "message's release, expected 1 (the held import's)")
        c.control(DROP_HELD)
        opens6, open_handles = c.control(REPORT)
        check(open_handles == 0 and opens6 == opens5,
              f"keep_warm(0): after the held import's release {open_handles} handle(s) open (expected 0), "
              f"{opens6 - opens5} new open(s) (expected 0)")
        s = wait_stats(c.conn, lambda s: s["live_leases"] == 0)
        check(s["live_leases"] == 0 and s["granted"] == s["released"], f"producer's leases not all released: {s}")
        c.finish()
        return (f"keep_warm(16): 1 open for {k} messages; keep_warm(0): {k} opens for {k} messages, 0 left open; "
                "a message while an import lives: 0 opens")
    finally:
        c.kill()


RING_LIMITS = dict(cuda_ring_device=0, cuda_ring_slot_bytes=64 << 10, cuda_ring_slots=4)


def test_gpu_ring():
    c = Child("drop", **RING_LIMITS)
    try:
        cases = []
        for dtype in DTYPES:
            base = random_cuda((6, 8), dtype)
            cases += [(f"{dtype} {name}", t) for name, t in views_of(base).items()]
        cases.append(("3 MiB in 48 chunks", random_cuda((3 << 20,), torch.uint8)))
        # The consumer opened the producer's arena once, at connection setup (the
        # handshake has completed when the child answers).
        opens0, open_handles0 = c.control(REPORT)
        check(opens0 == 1 and open_handles0 == 1,
              f"consumer after connection setup: {opens0} cuIpcOpenMemHandle call(s), {open_handles0} handle(s) open; "
              "expected 1 and 1 (the ring's arena)")
        c.conn.send(tensorwire.to_shared(torch.tensor([len(cases)])), RING_ECHO)
        for tag, (what, t) in enumerate(cases, 1):
            c.conn.ring_send(t, tag)  # no synchronize
            packed = t.clone(memory_format=torch.contiguous_format)  # a storage of exactly the view's bytes
            meta = c.recv(tag).tolist()
            got = c.recv(tag)
            want = [t.element_size(), *t.shape, *packed.stride(), 1]
            check(meta == want, f"{what}: consumer got layout {meta}, expected {want}")
            check(torch.equal(got, storage_bytes(packed).cpu()), f"{what}: consumer's bytes differ from the packed view")
        cycles = sleep_cycles_for(1000)
        # 4 MiB: 64 chunks through 4 slots, ~4 stream operations each — well inside what a
        # stream queues without blocking the host, so ring_send returns while the sleep runs.
        t = torch.zeros(1 << 20, device="cuda")
        c.conn.send(tensorwire.to_shared(torch.tensor([3])), RING_MINMAX)
        for i in range(1, 4):
            torch.cuda.synchronize()
            torch.cuda._sleep(cycles)
            t.fill_(float(i))
            c.conn.ring_send(t, i)  # returns once the last chunk is queued; no synchronize
            busy = not torch.cuda.current_stream().query()
            check(busy, "the fill finished before ring_send returned: sleep too short to prove ordering")
            lo, hi = c.recv(i).tolist()
            check(lo == hi == float(i), f"ordering round {i}: consumer read min {lo}, max {hi}")
        opens1, open_handles1 = c.control(REPORT)
        n = len(cases) + 3
        check(opens1 == opens0,
              f"consumer: {opens1 - opens0} cuIpcOpenMemHandle call(s) during {n} GPU ring messages, expected 0 "
              "(the arena is opened once, at connection setup)")
        check(open_handles1 == open_handles0, f"consumer: {open_handles1} handle(s) open after the ring traffic, "
              f"{open_handles0} before")
        c.finish()
        return (f"{len(cases)} tensors echoed, 3 ordering rounds of 4 MiB in 64 chunks; consumer opens: "
                f"{opens0} at setup, +{opens1 - opens0} over {n} messages")
    finally:
        c.kill()


def test_vmm():
    # The producer is the child (its allocator must be configured before CUDA starts).
    parent_fd, child_fd = tensorwire.socketpair()
    # Both names (PYTORCH_ALLOC_CONF is the newer one; scripts/gpu_test.sh sets both to
    # expandable_segments:False for everything else).
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True",
               PYTORCH_ALLOC_CONF="expandable_segments:True")
    proc = subprocess.Popen([sys.executable, __file__, "--vmm-producer", str(child_fd)], pass_fds=[child_fd], env=env)
    os.close(child_fd)
    conn = tensorwire.from_fd(parent_fd)
    try:
        opens0 = tensorwire.cuda_ipc_cache_stats()["opens"]
        t, tag = conn.recv_tagged(timeout=120)
        if tag == VMM_NO_FD:
            proc.wait(timeout=120)
            raise Skipped("this PyTorch's expandable segments are not created with the POSIX-fd "
                          "handle type, so VMM export by fd cannot be exercised with them")
        check(t.is_cuda and t.numel() == 1 << 18, f"got {t.device} {t.shape}")
        check(torch.equal(t.cpu(), torch.arange(1 << 18, dtype=torch.float32) * 3), "values differ")
        t[0] = -1
        torch.cuda.synchronize()
        del t
        flush_releases(conn)
        opens1 = tensorwire.cuda_ipc_cache_stats()["opens"]
        # VMM memory is mapped from the allocation's fd and never touches the IPC handle
        # cache: an open here means the tensor came through legacy IPC (not VMM memory).
        check(opens1 == opens0, f"the import opened {opens1 - opens0} IPC handle(s): it came through legacy "
              "cudaIpc, not a VMM export by fd (is the producer's allocator using expandable segments?)")
        ack(conn, tag)
        verdict = conn.recv(timeout=120).tolist()
        check(verdict == [1], f"producer did not see the consumer's write: {verdict}")
        ack(conn, 3)  # the verdict is in: the producer may close (closing ends its leases)
        check(proc.wait(timeout=120) == 0, "producer failed")
        return "expandable-segments tensor shared by fd (no IPC handle opened), zero-copy"
    finally:
        if proc.poll() is None:
            proc.kill()
        conn.close()


def vmm_producer(fd):
    conn = tensorwire.from_fd(fd)
    t = torch.arange(1 << 18, dtype=torch.float32, device="cuda") * 3  # 1 MiB, expandable segment
    try:
        conn.send(t, 1)
    except RuntimeError as e:
        if "without the POSIX-fd handle type" not in str(e):
            raise
        print(f"vmm producer: {e}", flush=True)
        conn.send(tensorwire.to_shared(torch.tensor([0])), VMM_NO_FD)
        conn.close()
        return
    conn.recv(timeout=120)  # the consumer wrote and released
    ack(conn, 2, [int(t[0].item() == -1)])
    # Closing ends every lease this side granted, the verdict's too: wait until it is read.
    conn.recv(timeout=120)
    conn.close()


def forward_child(role, host_fd, link_fd):
    """The relay or the last of test_forward: HOST_FD to the test, LINK_FD between them."""
    host = tensorwire.from_fd(host_fd)
    link = tensorwire.from_fd(link_fd)
    held = None
    while True:
        if role == "relay":
            u, tag = host.recv_tagged(timeout=120)
            if tag == STOP:
                break
            opens0 = tensorwire.cuda_ipc_cache_stats()["opens"]
            u[1, 0] = -5  # queued on the current stream, before the forward
            zero_copy = link.send(u[1:], tag)
            opens1 = tensorwire.cuda_ipc_cache_stats()["opens"]
            del u  # only the forward's lease holds the import now
            ack(host, tag, [int(zero_copy), opens1 - opens0])
        else:
            cmd, tag = host.recv_tagged(timeout=120)
            del cmd
            if tag == STOP:
                break
            if tag == TAKE:
                held = link.recv(timeout=120)
                vals = [*held.shape, held[0, 0].item(), held[1, 3].item()]
                held[0, 1] = 42  # into the host's memory
                ack(host, tag, vals)
            elif tag == RELEASE:
                held = None
                flush_releases(link)
                ack(host, tag)
    link.close()
    host.close()


def test_forward():
    rows, cols = 64, 1024
    h_r, r_h = tensorwire.socketpair()
    h_l, l_h = tensorwire.socketpair()
    r_l, l_r = tensorwire.socketpair()
    procs = [
        subprocess.Popen([sys.executable, __file__, "--forward", role, str(a), str(b)], pass_fds=[a, b])
        for role, a, b in (("relay", r_h, r_l), ("last", l_h, l_r))
    ]
    for fd in (r_h, r_l, l_h, l_r):
        os.close(fd)
    to_relay = tensorwire.from_fd(h_r)
    to_last = tensorwire.from_fd(h_l)

    def ask_last(tag):
        to_last.send(tensorwire.to_shared(torch.tensor([0])), tag)
        t, got = to_last.recv_tagged(timeout=120)
        check(got == tag, f"reply tag {got}, expected {tag}")
        return t.tolist()

    try:
        cycles = sleep_cycles_for(200)
        values = torch.arange(rows * cols, dtype=torch.float32, device="cuda").reshape(rows, cols)
        t = torch.zeros(rows, cols, device="cuda")
        torch.cuda.synchronize()
        torch.cuda._sleep(cycles)  # the stream is busy ~200 ms ...
        t.copy_(values)            # ... then the values, queued before the send
        to_relay.send(t, 1)        # no synchronize: the events order the relay and the last
        busy = not torch.cuda.current_stream().query()
        check(busy, "the copy finished before send returned: sleep too short to prove ordering")
        r, tag = to_relay.recv_tagged(timeout=120)
        check(tag == 1 and r.tolist() == [1, 0], f"relay: [zero-copy forward, IPC opens for it] = {r.tolist()}")
        got = ask_last(TAKE)
        check(got == [rows - 1, cols, -5.0, float(values[2, 3])], f"the last read {got}")
        time.sleep(0.05)
        s = to_relay.stats()
        check(s["live_leases"] == 1, f"the host's lease ended while the last holds the forward: {s}")
        ask_last(RELEASE)
        s = wait_stats(to_relay, lambda s: s["live_leases"] == 0)
        check((s["live_leases"], s["released"], s["reclaimed"]) == (0, 1, 0), f"after the last released: {s}")
        torch.cuda.synchronize()
        check(t[1, 1].item() == 42 and t[1, 0].item() == -5, "the last's / relay's write is not in the host's tensor")
        to_relay.send(tensorwire.zeros(1), STOP)
        to_last.send(tensorwire.zeros(1), STOP)
        check([p.wait(timeout=120) for p in procs] == [0, 0], "relay or last failed")
        return "host -> relay -> last, one CUDA allocation, no IPC open in the relay"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        to_relay.close()
        to_last.close()


TESTS = {
    "dtypes_and_views": test_dtypes_and_views,
    "zero_copy": test_zero_copy,
    "ordering": test_ordering,
    "sigkill": test_sigkill,
    "handle_cache": test_handle_cache,
    "gpu_ring": test_gpu_ring,
    "vmm": test_vmm,
    "forward": test_forward,
}


def main():
    if len(sys.argv) >= 2 and sys.argv[1] == "--child":
        return child_main(sys.argv[2], int(sys.argv[3]))
    if len(sys.argv) >= 2 and sys.argv[1] == "--vmm-producer":
        return vmm_producer(int(sys.argv[2]))
    if len(sys.argv) >= 2 and sys.argv[1] == "--forward":
        return forward_child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    names = sys.argv[1:] or list(TESTS)
    if not torch.cuda.is_available():
        for name in names:
            print(f"SKIPPED {name}: no CUDA device")
        print("GPU tests SKIPPED: no CUDA device")
        return 2
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, tensorwire CUDA built: "
          f"{tensorwire.cuda_built()}, available: {tensorwire.cuda_available()}", flush=True)
    failed = skipped = 0
    for name in names:
        t0 = time.perf_counter()
        try:
            note = TESTS[name]()
            print(f"PASS {name} ({time.perf_counter() - t0:.1f} s){': ' + note if note else ''}", flush=True)
        except Skipped as e:
            skipped += 1
            print(f"SKIPPED {name}: {e}", flush=True)
        except Exception as e:  # noqa: BLE001  (report every failure, go on)
            failed += 1
            print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)
            traceback.print_exc()
    print(f"gpu tests: {len(names) - failed - skipped} passed, {failed} failed, {skipped} SKIPPED")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
