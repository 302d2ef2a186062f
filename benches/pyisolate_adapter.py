#!/usr/bin/env python3
"""Per-call latency of a pyisolate call carrying one CPU tensor (1 MiB and 64 MiB), with
and without tensorwire's pyisolate adapter, same run: each variant is a real pyisolate
host (python/tests/pyisolate_host.py, scenario `bench`) calling a child method that
receives the tensor and drops it. Not part of the tests. Usage:

  .venv/bin/python benches/pyisolate_adapter.py [--rounds N]

Needs the package installed (pip install --no-build-isolation .) and uv (pyisolate
makes the child's venv with it; the project's .tools/uv is used when none is on PATH).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HOST = ROOT / "python" / "tests" / "pyisolate_host.py"


def run(adapter: bool, venv_root: str, env: dict) -> dict:
    cmd = [sys.executable, str(HOST), "bench", "--venv-root", venv_root] + (["--adapter"] if adapter else [])
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    lines = [l for l in r.stdout.splitlines() if l.startswith("RESULT ")]
    if r.returncode != 0 or not lines:
        sys.exit(f"host failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2, help="alternating runs of each variant (default 2)")
    args = ap.parse_args()
    env = dict(os.environ)
    if shutil.which("uv") is None and (ROOT / ".tools/uv/bin/uv").exists():
        env["PATH"] = f"{ROOT / '.tools/uv/bin'}{os.pathsep}{env.get('PATH', '')}"
        env.setdefault("UV_CACHE_DIR", str(ROOT / ".tools/uv-cache"))
    results: dict = {False: [], True: []}
    with tempfile.TemporaryDirectory() as venv_root:
        for _ in range(args.rounds):
            for adapter in (False, True):
                results[adapter].append(run(adapter, venv_root, env))
    sizes = list(results[False][0])
    print(f"pyisolate call carrying one CPU tensor (child receives and drops it); p50 of "
          f"{results[False][0][sizes[0]]['iters']} calls per run, median over {args.rounds} run(s), microseconds")
    print(f"{'size':>8} | {'pyisolate':>10} | {'+ tensorwire':>12} | {'speed-up':>8}")
    for s in sizes:
        base = statistics.median(r[s]["p50_us"] for r in results[False])
        tw = statistics.median(r[s]["p50_us"] for r in results[True])
        print(f"{int(s) >> 20:>5} MiB | {base:10.0f} | {tw:12.0f} | {base / tw:7.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
