#!/usr/bin/env python3
"""Import loops between the modules of a Python package: the check that keeps them one way.

Every `import` and `from ... import` of the package's own modules counts, at module level
and inside functions alike: an import moved into a function to get round a loop still
makes the two modules depend on each other (it only defers the failure to the first
call). What an `if TYPE_CHECKING:` block imports is not run, so it does not count. An
import of `pkg.a.b` counts as an edge to `pkg.a.b` only, not to the packages above it
(Python initialises those first, whoever imports). `from pkg import name` is an edge to
`pkg.name` when that is a module of the package, else to `pkg` itself.

Any cycle is printed with the import that makes each step (`file:line`, and `in a
function` where the import is deferred), and the exit status is 1. `--deferred` lists the
package's imports of its own modules made inside functions.

  python3 scripts/python_imports.py python/tensorwire
  python3 scripts/python_imports.py --deferred python/tensorwire
  python3 scripts/python_imports.py --self-test
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

# The loop finder and the self-tests' case runner both checks share (this script's folder
# is first on sys.path).
from module_graph import cycles, misjudged


def module_names(pkg: Path) -> dict[str, Path]:
    """Dotted name -> file for every module of the package (extension modules included,
    so that `from . import _native` names a module, not an attribute)."""
    out: dict[str, Path] = {}
    for f in sorted(pkg.rglob("*")):
        if f.suffix not in (".py", ".so", ".pyi") or "__pycache__" in f.parts:
            continue
        rel = f.relative_to(pkg.parent)
        parts = list(rel.parts)
        parts[-1] = parts[-1].split(".")[0]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        name = ".".join(parts)
        if f.suffix == ".py" or name not in out:
            out[name] = f
    return out


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


Edge = tuple[str, str, str, bool]  # (from, to, "file:line", deferred)


def imports(name: str, f: Path, mods: dict[str, Path]) -> list[Edge]:
    tree = ast.parse(f.read_text(), str(f))
    is_pkg = f.name == "__init__.py"
    out: list[Edge] = []

    def target(dotted: str) -> str | None:
        # The deepest module of the package the dotted name reaches.
        parts = dotted.split(".")
        for n in range(len(parts), 0, -1):
            if ".".join(parts[:n]) in mods:
                return ".".join(parts[:n])
        return None

    def visit(node: ast.AST, deferred: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and is_type_checking(child.test):
                for c in child.orelse:
                    visit_stmt(c, deferred)
                continue
            visit_stmt(child, deferred)

    def visit_stmt(child: ast.AST, deferred: bool) -> None:
        where = f"{f}:{getattr(child, 'lineno', 0)}"
        if isinstance(child, ast.Import):
            for a in child.names:
                t = target(a.name)
                if t:
                    out.append((name, t, where, deferred))
        elif isinstance(child, ast.ImportFrom):
            if child.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (child.level - 1)]
                mod = ".".join(base + ([child.module] if child.module else []))
            else:
                mod = child.module or ""
            for a in child.names:
                t = target(f"{mod}.{a.name}") if f"{mod}.{a.name}" in mods else target(mod)
                if t:
                    out.append((name, t, where, deferred))
        elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            visit(child, True)
        else:
            visit(child, deferred)

    visit(tree, False)
    return [e for e in out if e[1] != name]


def check(pkg: Path) -> tuple[list[str], list[Edge]]:
    mods = module_names(pkg)
    edges: list[Edge] = []
    for name, f in mods.items():
        if f.suffix == ".py":
            edges.extend(imports(name, f, mods))
    graph: dict[str, set[str]] = defaultdict(set)
    first: dict[tuple[str, str], Edge] = {}
    for e in edges:
        graph[e[0]].add(e[1])
        # Name a module-level import where there is one: it is the one that runs first.
        if (e[0], e[1]) not in first or (first[(e[0], e[1])][3] and not e[3]):
            first[(e[0], e[1])] = e
    loops = []
    for cycle in cycles(graph):
        steps = []
        for i, a in enumerate(cycle):
            b = cycle[(i + 1) % len(cycle)]
            e = first[(a, b)]
            steps.append(f"{a} -> {b} ({e[2]}{', in a function' if e[3] else ''})")
        loops.append(" -> ".join(cycle + [cycle[0]]) + ": " + "; ".join(steps))
    return loops, [e for e in edges if e[3]]


def self_test() -> int:
    """Small packages with and without loops: each must be judged as expected."""
    cases = {
        "a module-level loop": ({"__init__.py": "", "a.py": "from . import b", "b.py": "from .a import X"}, 1),
        "a loop through an import inside a function": (
            {"__init__.py": "", "a.py": "from .b import Y", "b.py": "def f():\n    from . import a\n"}, 1),
        "a loop through the package's __init__": (
            {"__init__.py": "from .a import X", "a.py": "import pkg\nfrom pkg import c"}, 1),
        "absolute imports of submodules": (
            {"__init__.py": "", "a.py": "import pkg.b", "b.py": "import pkg.c", "c.py": "import pkg.a as a"}, 1),
        "a three-module loop": (
            {"__init__.py": "", "a.py": "from .b import X", "b.py": "from .c import Y", "c.py": "from . import a"}, 1),
        "imports going one way": (
            {"__init__.py": "from . import a, b", "a.py": "from .b import X", "b.py": "import os\nfrom . import _native"}, 0),
        "a submodule importing a sibling while the package imports both": (
            {"__init__.py": "from .a import X\nfrom .b import Y", "a.py": "from .b import Y", "b.py": ""}, 0),
        "an import only for type checking": (
            {"__init__.py": "", "a.py": "from .b import Y",
             "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import X\n"}, 0),
    }
    # Each case is the package `pkg`, with an (empty) extension module beside its files.
    in_pkg = {name: ({"pkg/_native.abi3.so": "", **{f"pkg/{rel}": text for rel, text in tree.items()}}, want)
              for name, (tree, want) in cases.items()}
    bad = misjudged("python import", in_pkg, lambda d: check(d / "pkg")[0])
    print(f"python import self-test: {len(cases) - bad} of {len(cases)} cases judged right")
    return 1 if bad else 0


def main(argv: list[str]) -> int:
    args = argv[1:]
    if args == ["--self-test"]:
        return self_test()
    deferred_listing = "--deferred" in args
    dirs = [a for a in args if a != "--deferred"] or ["python/tensorwire"]
    failed = False
    for d in dirs:
        loops, deferred = check(Path(d))
        for l in loops:
            print(f"import loop: {l}")
        failed |= bool(loops)
        if deferred_listing:
            for a, b, where, _ in deferred:
                print(f"import inside a function: {a} -> {b} ({where})")
        if not loops:
            print(f"python imports: no import loop among the modules of {d} "
                  f"({len(deferred)} of their imports of each other are inside functions; counted)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
