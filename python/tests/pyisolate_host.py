"""A real pyisolate host with one isolated child (python/tests/pyisolate_exts/pyisolate_ext), used by
test_pyisolate.py and benches/pyisolate_adapter.py:

    python pyisolate_host.py SCENARIO [--adapter | --compose reference|mock] [--venv-root DIR]

The child runs TensorExtension (pyisolate_ext_api.py: pyisolate imports it by name there), in its own process started by pyisolate
(share_torch, sandbox disabled: bubblewrap is not assumed); the ``sealed`` scenario runs a
sealed worker (pyisolate_sealed_ext) instead. With --adapter the host registers
tensorwire.pyisolate.TensorwireAdapter first; with --compose, ``compose()`` of one of
pyisolate's reference adapters (pyisolate_reference_adapters.py). Each scenario prints one
JSON line of results on stdout, then the host ends as any program does (no ``os._exit``):
its exit status is part of what the tests check (0, with the adapter too).
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
# The extensions sit two levels below this folder: pyisolate puts an extension's
# grandparent first on the child's sys.path (an application's root, in its layout), and
# here that must be this folder, not python/, whose tensorwire (a checkout without its
# built binding) would shadow the installed package in the child.
EXTS = HERE / "pyisolate_exts"
from pyisolate_ext_api import TensorExtension  # noqa: E402  (importable in the child too)


def _config(name: str) -> ExtensionConfig:
    return ExtensionConfig(name=name, module_path=str(EXTS / "pyisolate_ext"), isolated=True, dependencies=[],
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
    # A call without tensors first: the child's hello precedes its answer, so once it is
    # back the pairing is agreed and every tensor below travels through tensorwire.
    await ext.pid()
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
        # The child's sockets close (its leases come back) a moment before the kernel
        # shows it as a zombie, which is when its link counts as gone: wait for both.
        deadline, stats, closed = time.monotonic() + 10, {}, False
        while time.monotonic() < deadline:
            stats = TensorwireAdapter.host_stats(prune=False).get(pid, {})
            if stats.get("live_leases") == 0:
                closed = pid not in TensorwireAdapter.host_stats()
                if closed:
                    break
            await asyncio.sleep(0.02)
        out["after_kill"] = stats
        out["child_link_closed"] = closed
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


def _tw_shared(t) -> bool:
    """Whether ``t`` lives in a tensorwire segment (it came through tensorwire)."""
    import tensorwire
    return tensorwire.is_shared(t)


def _stats(adapter):
    if not adapter:
        return {}
    from tensorwire.pyisolate import TensorwireAdapter
    return {str(k): v for k, v in TensorwireAdapter.host_stats().items()}


async def scenario_slow(ext, adapter):
    """The child is slow to start ($TW_PYISOLATE_CHILD_DELAY_S, see pyisolate_delay): the
    first call, carrying a tensor, is sent while the child is still asleep, before it has
    any tensorwire connection. Every call must still succeed; the first tensor travels by
    pyisolate's own path, the later ones through tensorwire once the child has paired."""
    out = {}
    t0 = time.monotonic()
    out["first"] = await ext.info(torch.ones(2, 3))
    out["first_call_s"] = time.monotonic() - t0
    out["stats_after_first"] = _stats(adapter)
    made = await ext.make(4)
    out["made"], out["made_is_shared"] = made.tolist(), bool(_tw_shared(made))
    t = torch.arange(6, dtype=torch.float32)
    out["echo_equal"] = bool(torch.equal(await ext.echo(t), t))
    out["second"] = await ext.info(torch.ones(3))
    out["stats"] = _stats(adapter)
    return out


async def scenario_unpaired(ext, adapter):
    """The child connected to a decoy listener (its $TENSORWIRE_PYISOLATE_SOCKET points
    there), so the host cannot pair it: the host never acks, and neither side may send a
    reference. Tensors must travel by pyisolate's path both ways."""
    out = {}
    out["made"] = (await ext.make(3)).tolist()  # child -> host
    t = torch.arange(4, dtype=torch.float32)
    out["echo_equal"] = bool(torch.equal(await ext.echo(t), t))  # both ways
    out["info"] = await ext.info(torch.ones(2))
    out["stats"] = _stats(adapter)
    return out


async def scenario_sealed(ext, adapter):
    """A sealed worker: no adapter there (pyisolate gives it no ``adapter_ref``). Its
    tensors travel as pyisolate's JSON tensors; the host must know from pyisolate's
    bootstrap that it will not connect (no wait, no warning)."""
    out = {}
    pid = await ext.pid()
    t0 = time.monotonic()
    out["shape"] = await ext.shape(torch.ones(2, 5))
    out["first_tensor_s"] = time.monotonic() - t0
    out["shape2"] = await ext.shape(torch.ones(3))
    out["paired"] = str(pid) in _stats(adapter)
    return out


async def scenario_compose(ext, adapter):
    """tensorwire composed with one of pyisolate's reference adapters: both serve."""
    from pyisolate._internal.adapter_registry import AdapterRegistry

    out = {}
    await ext.pid()
    out["child_adapter"] = await ext.adapter_info()
    host = AdapterRegistry.get()
    out["host_adapter"] = {"type": type(host).__name__, "identifier": host.identifier,
                           "inner": type(host.inner).__name__}
    if type(host.inner).__name__ == "MockHostAdapter":
        from pyisolate_reference_adapters import MockTestData
        out["mock_double"] = await ext.mock_double(MockTestData(21))
        out["registry_kind"] = await ext.registry_kind()
    t = torch.arange(6, dtype=torch.float32)
    out["echo_equal"] = bool(torch.equal(await ext.echo(t), t))
    out["made"] = (await ext.make(3)).tolist()
    out["stats"] = _stats(adapter)
    return out


async def scenario_hold(ext, adapter):
    """Pair, then wait to be killed: prints READY with this host's and its child's pids."""
    pid = await ext.pid()
    await ext.info(torch.ones(2))
    print("READY " + json.dumps({"host": os.getpid(), "child": pid, "stats": _stats(adapter)}), flush=True)
    while True:
        await asyncio.sleep(3600)


SCENARIOS = {"roundtrip": scenario_roundtrip, "sigkill": scenario_sigkill, "bench": scenario_bench,
             "slow": scenario_slow, "unpaired": scenario_unpaired, "sealed": scenario_sealed,
             "compose": scenario_compose, "hold": scenario_hold}


def _decoy_listener():
    """A tensorwire listener that is not the host adapter's (scenario ``unpaired``): it
    accepts the child's connection in a thread and keeps it."""
    import tempfile
    import threading

    from tensorwire import connection

    path = os.path.join(tempfile.mkdtemp(prefix="tw-decoy-"), "decoy.sock")
    listener = connection.listen(path)
    kept = []
    threading.Thread(target=lambda: kept.append(listener.accept(timeout=120)), daemon=True).start()
    return path, (listener, kept)


async def main_async(args) -> dict:
    adapter = args.adapter or bool(args.compose)
    if args.compose:
        import pyisolate_reference_adapters as refs
        from tensorwire.pyisolate import compose
        pyisolate.register_adapter(compose(refs.ReferenceAdapter() if args.compose == "reference"
                                           else refs.MockHostAdapter()))
    elif args.adapter:
        from tensorwire.pyisolate import TensorwireAdapter
        pyisolate.register_adapter(TensorwireAdapter())
    if args.scenario == "sealed":
        sys.path.insert(0, str(EXTS / "pyisolate_sealed_ext"))
        from sealed_ext_api import SealedExtension
        manager = ExtensionManager(SealedExtension, {"venv_root_path": args.venv_root})
        config = ExtensionConfig(name="tw_sealed_ext", module_path=str(EXTS / "pyisolate_sealed_ext"),
                                 isolated=True, dependencies=[], apis=[], share_torch=False,
                                 share_cuda_ipc=False, execution_model="sealed_worker",
                                 sandbox_mode=SandboxMode.DISABLED)
    else:
        manager = ExtensionManager(TensorExtension, {"venv_root_path": args.venv_root})
        config = _config("tw_test_ext")
        if args.sandbox:
            # In bubblewrap: the child sees what is bound; it imports the extension's
            # class from here (tensorwire's own directory the adapter binds itself).
            config["sandbox_mode"] = SandboxMode.REQUIRED
            config["sandbox"] = {"readonly_paths": [str(HERE)]}
        if args.scenario == "compose":
            del config["apis"]  # pyisolate takes them from the adapter: the host adapter's services
        if args.scenario == "unpaired":
            import tensorwire._pyisolate_link as twl
            import tensorwire.pyisolate as twp
            twl.LINK_WAIT_S = 0.2  # the child's link never comes to this host; no need to wait long
            decoy_path, _keep = _decoy_listener()
            config["env"] = {twp.SOCKET_ENV: decoy_path}
    ext = manager.load_extension(config)
    try:
        return await SCENARIOS[args.scenario](ext, adapter)
    finally:
        try:
            manager.stop_all_extensions()
        except Exception:
            pass


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario", choices=sorted(SCENARIOS))
    ap.add_argument("--adapter", action="store_true")
    ap.add_argument("--compose", choices=("reference", "mock"))
    ap.add_argument("--sandbox", action="store_true", help="run the child in bubblewrap (pyisolate's default)")
    ap.add_argument("--venv-root", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "tensorwire-pyisolate-venvs"))
    args = ap.parse_args()
    result = asyncio.run(main_async(args))
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
