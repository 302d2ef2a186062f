"""``python -m tensorwire demo | doctor | bench [rpc]`` (also the ``tensorwire`` console script)."""

from __future__ import annotations

import sys
from typing import Optional

USAGE = """usage: python -m tensorwire COMMAND [ARGS]

commands:
  demo     two processes share tensors both ways through torch; zero-copy proven
  doctor   one line per capability this machine needs (with what to do when missing)
  bench    latency vs torch.multiprocessing and pickle: a table and a PNG plot
  bench rpc  calls into a worker process: tensorwire.rpc vs pyisolate, ProcessPoolExecutor
             and a multiprocessing.Pipe loop (payloads, cold start, warm pool): table and PNG
"""


def main(argv: Optional[list[str]] = None) -> int:
    """Dispatch to the command's own ``main``; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return 0 if args else 2
    cmd, rest = args[0], args[1:]
    if cmd == "demo":
        from . import demo
        return demo.main(rest)
    if cmd == "doctor":
        from . import doctor
        return doctor.main(rest)
    if cmd == "bench" and rest[:1] == ["rpc"]:
        from . import bench_rpc
        return bench_rpc.main(rest[1:])
    if cmd == "bench":
        from . import bench
        return bench.main(rest)
    print(f"python -m tensorwire: unknown command {cmd!r}\n\n{USAGE}", end="", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
