#!/usr/bin/env python3
"""Per-transfer latency of a shared CPU tensor between two Python processes against
torch.multiprocessing and pickle, same run: the bench lives in the package
(``python -m tensorwire bench``, python/tensorwire/bench.py); this script runs it from a
checkout, writing the plot to build/torch_transfer.png, and says whether the
project's target (docs/DESIGN.md, "Performance targets": >= 20x lower p50 than
torch.multiprocessing at every size) held. Usage:

  .venv/bin/python benches/torch_transfer.py [--iters N] [--png PATH] [--max-size BYTES]

Uses the installed package (pip install --no-build-isolation .) or, failing that, the
checkout's python/ with $TENSORWIRE_TORCH_LIB.
"""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
try:
    import tensorwire.bench as bench
except ImportError:
    sys.path.insert(0, str(ROOT / "python"))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "python"), os.environ.get("PYTHONPATH")]))
    import tensorwire.bench as bench

TARGET = 20.0


def verdict(p50):
    worst = min(p50["torch.mp"][s] / p50["tensorwire"][s] for s in p50["tensorwire"])
    print(f"target: >= {TARGET:.0f}x lower p50 than torch.multiprocessing at every size: "
          f"{'met' if worst >= TARGET else 'NOT met'} (worst {worst:.1f}x)")


if __name__ == "__main__":
    sys.exit(bench.main(sys.argv[1:], default_png=str(ROOT / "build" / "torch_transfer.png"), on_results=verdict))
