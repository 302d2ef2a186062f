"""A real pyisolate host with one isolated child (tests/python/pyisolate_ext), used by
test_pyisolate.py and benches/pyisolate_adapter.py:

    python pyisolate_host.py SCENARIO [--adapter] [--venv-root DIR]

The child runs TensorExtension (pyisolate_ext_api.py: pyisolate imports it by name there), in its own process started by pyisolate
(share_torch, sandbox disabled: bubblewrap is not assumed). With --adapter the host
registers tensorwire.pyisolate.TensorwireAdapter first. Each scenario prints one JSON
line of results on stdout, then the host ends as any program does (no ``os._exit``): its
exit status is part of what the tests check (0, with the adapter too).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path

import torch

import pyisolate
from pyisolate import ExtensionConfig, ExtensionManager, SandboxMode

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from pyisolate_ext_api import TensorExtension  # noqa: E402  (importable in the child too)


def _config(name: str) -> ExtensionConfig:
    return ExtensionConfig(name=name, module_path=str(HERE / "pyisolate_ext"), isolated=True, dependencies=[],
                           apis=[], share_torch=True, share_cuda_ipc=False, sandbox_mode=SandboxMode.DISABLED)


def _shm_files() -> set:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def _others(name: str, child: int) -> bool:
    """A torch file_system file another process made (torch names them
    ``torch_<creator pid>_...``): a test running beside this one, not this host or its
    child."""
    parts = name.split("_")
    return len(parts) > 2 and parts[0] == "torch" and parts[1].isdigit() and int(parts[1]) not in (os.getpid(), child)


async def scenario_roundtrip(ext, adapter):
    import tensorwire

    out = {}
    plain = torch.arange(12, dtype=torch.float32).view(3, 4).t()  # strided, not in a segment
    out["plain"] = await ext.info(plain)  # copied once into a segment (packed)
    out["segment_view"] = await ext.info(tensorwire.zeros(4, 6).t())  # zero-copy: the view's strides arrive
    shared = tensorwire.zeros(1024)
    await ext.flip(shared)
    out["flip_seen_by_host"] = float(shared[0])  # 1.0 only if the child wrote our memory
    made = await ext.make(5)
    out["made"] = made.tolist()
    out["made_is_shared"] = bool(tensorwire.is_shared(made))
    back = await ext.echo(plain)
    out["echo_equal"] = bool(torch.equal(back, plain))
    out["nested"] = (await ext.info(torch.ones(2, 3)))["sum"]
    if adapter:
        from tensorwire.pyisolate import TensorwireAdapter
        out["host_stats"] = {str(k): v for k, v in TensorwireAdapter.host_stats().items()}
    return out


def _memfd_mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum("/memfd:" in line for line in f)


async def scenario_sigkill(ext, adapter):
    """The child holds tensors the host sent; SIGKILL it. With the adapter, the host
    must reclaim every lease (the child's death seen through its connection), and once
    the host drops its own tensors no segment stays mapped; /dev/shm gains no file
    holding tensor data (pyisolate's own multiprocessing semaphores, sem.*, aside)."""
    import gc

    before_files, before_maps = _shm_files(), _memfd_mappings()
    pid = await ext.pid()
    tensors = [torch.ones(1 << 18) for _ in range(4)]
    if adapter:
        import tensorwire
        tensors.append(tensorwire.zeros(1 << 18))  # already in a segment: shared zero-copy
    for t in tensors:
        await ext.hold(t)
    # pyisolate's send thread keeps its last request (and so that request's tensor)
    # referenced until it sends the next one: end with a call that carries none.
    await ext.pid()
    out = {}
    if adapter:
        from tensorwire.pyisolate import TensorwireAdapter
        out["held_before_kill"] = TensorwireAdapter.host_stats()[pid]["live_leases"]
    os.kill(pid, signal.SIGKILL)
    if adapter:
        deadline, stats = time.monotonic() + 10, {}
        while time.monotonic() < deadline:
            stats = TensorwireAdapter.host_stats(prune=False).get(pid, {})
            if stats.get("live_leases") == 0:
                break
            await asyncio.sleep(0.02)
        out["after_kill"] = stats
        out["child_link_closed"] = pid not in TensorwireAdapter.host_stats()
    else:
        await asyncio.sleep(1.0)
    del tensors, t
    gc.collect()
    out["memfd_mappings_left"] = _memfd_mappings() - before_maps
    out["shm_files_left"] = sorted(f for f in _shm_files() - before_files if not f.startswith("sem.") and not _others(f, pid))
    return out


async def scenario_bench(ext, adapter, sizes=(1 << 20, 64 << 20), iters=30):
    out = {}
    await ext.pid()
    for size in sizes:
        t = torch.ones(size // 4, dtype=torch.float32)
        for _ in range(3):
            await ext.touch(t)
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            await ext.touch(t)
            times.append(time.perf_counter() - t0)
        out[str(size)] = {"p50_us": statistics.median(times) * 1e6, "min_us": min(times) * 1e6, "iters": iters}
    return out


SCENARIOS = {"roundtrip": scenario_roundtrip, "sigkill": scenario_sigkill, "bench": scenario_bench}


async def main_async(args) -> dict:
    if args.adapter:
        from tensorwire.pyisolate import TensorwireAdapter
        pyisolate.register_adapter(TensorwireAdapter())
    manager = ExtensionManager(TensorExtension, {"venv_root_path": args.venv_root})
    ext = manager.load_extension(_config("tw_test_ext"))
    try:
        return await SCENARIOS[args.scenario](ext, args.adapter)
    finally:
        try:
            manager.stop_all_extensions()
        except Exception:
            pass


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario", choices=sorted(SCENARIOS))
    ap.add_argument("--adapter", action="store_true")
    ap.add_argument("--venv-root", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "tensorwire-pyisolate-venvs"))
    args = ap.parse_args()
    result = asyncio.run(main_async(args))
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
