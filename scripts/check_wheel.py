"""Checks the package's wheel (the test command's wheel step): the promises pyproject.toml
makes to an installer, read from the built file rather than from the sources.

- the name says abi3 and manylinux_2_28, torch's own wheels' floor (an index takes it; it
  installs wherever torch does, under every CPython >= 3.10), and no symbol of the
  binding needs a newer glibc;
- the binding is inside, at tensorwire/_native.abi3.so, exports PyInit__native only (no
  `tw_*` C ABI, no SONAME of the C library's), and links nothing of torch, c10 or libpython (so any torch in the range and any interpreter can load it); the libtorch
  extension is not inside (it is torch-version specific);
- the metadata: the crate's version, torch as a range and never ``==``, the two license
  files, the CUDA classifier (CUDA support is built in: the driver loads at run time).

Usage: python scripts/check_wheel.py WHEEL   (exit 1 naming the first broken promise)
"""

from __future__ import annotations

import email.parser
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def fail(msg: str) -> None:
    print(f"check_wheel: {msg}", file=sys.stderr)
    sys.exit(1)


def main(path: str) -> None:
    wheel = Path(path)
    version = re.search(r'(?m)^version = "([^"]+)"', (ROOT / "python/native/Cargo.toml").read_text()).group(1)
    m = re.fullmatch(rf"tensorwire-{re.escape(version)}-cp310-abi3-(manylinux_2_28)_x86_64\.whl", wheel.name)
    if not m:
        fail(f"unexpected wheel name {wheel.name} (want tensorwire-{version}-cp310-abi3-manylinux_2_28_x86_64.whl)")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        if "tensorwire/_native.abi3.so" not in names:
            fail("tensorwire/_native.abi3.so is missing")
        if "tensorwire/ops.schemas" not in names:
            fail("tensorwire/ops.schemas (the op schemas _ops.py reads at import) is missing")
        if any("libtensorwire_torch" in n for n in names):
            fail("the libtorch extension is in the wheel")
        meta = email.parser.Parser().parsestr(z.read(f"tensorwire-{version}.dist-info/METADATA").decode())
        with tempfile.TemporaryDirectory() as d:
            so = z.extract("tensorwire/_native.abi3.so", d)
            dyn = subprocess.run(["readelf", "-d", so], check=True, capture_output=True, text=True).stdout
            syms = subprocess.run(["readelf", "-V", so], check=True, capture_output=True, text=True).stdout
            dynsyms = subprocess.run(["readelf", "--dyn-syms", "-W", so], check=True, capture_output=True, text=True).stdout
    exported = [f[-1] for f in (line.split() for line in dynsyms.splitlines())
                if len(f) >= 8 and f[6] != "UND" and f[4] == "GLOBAL" and f[3] == "FUNC"]
    if exported != ["PyInit__native"]:
        fail(f"_native must export PyInit__native only, exports {sorted(exported)[:8]}"
             f"{' ...' if len(exported) > 8 else ''} ({len(exported)})")
    soname = re.search(r"\(SONAME\)\s+Library soname: \[([^\]]+)\]", dyn)
    if soname:
        fail(f"_native carries the SONAME {soname.group(1)}")
    glibc = max((tuple(int(x) for x in v.split(".")) for v in re.findall(r"GLIBC_(\d+(?:\.\d+)+)", syms)), default=(0,))
    if glibc > (2, 28):
        fail(f"_native needs glibc {'.'.join(map(str, glibc))}, newer than manylinux_2_28 allows")
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dyn)
    bad = [n for n in needed if re.search(r"torch|c10|python|cuda", n)]
    if bad:
        fail(f"_native links {bad}; it must load under any torch and interpreter")
    if meta["Version"] != version:
        fail(f"metadata version {meta['Version']} != the crate's {version}")
    torch_reqs = [r for r in meta.get_all("Requires-Dist", []) if re.match(r"torch\b", r)]
    if len(torch_reqs) != 1 or "==" in torch_reqs[0] or ">=" not in torch_reqs[0] or "<" not in torch_reqs[0].replace("<=", ""):
        fail(f"torch must be required as a range (>=, <), never pinned: {torch_reqs}")
    licenses = sorted(meta.get_all("License-File", []))
    if licenses != ["LICENSE-APACHE", "LICENSE-MIT"] or meta["License-Expression"] != "MIT OR Apache-2.0":
        fail(f"license metadata: {licenses}, {meta['License-Expression']!r}")
    if "Environment :: GPU :: NVIDIA CUDA" not in meta.get_all("Classifier", []):
        fail("the CUDA classifier is missing")
    print(f"wheel: {wheel.name} ({m.group(1)}); _native needs {', '.join(needed)}; {torch_reqs[0]}; "
          f"{wheel.stat().st_size / 1e6:.1f} MB")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        fail("usage: check_wheel.py WHEEL")
    main(sys.argv[1])
