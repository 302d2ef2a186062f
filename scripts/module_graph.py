#!/usr/bin/env python3
"""Import loops between modules of a Rust crate: the check that keeps imports going one way.

For each source file (one module) it collects the paths it names (`crate::a::b`,
`super::x`, `self::y`, in `use` items and in expressions), resolves each to the deepest
module file it reaches, and projects every edge onto the siblings under the two modules'
lowest common ancestor (`peer::import -> peer::cuda_import` is an edge between siblings of
`peer`; `error -> ring::spsc` one between the top-level modules `error` and `ring`). An edge
between a module and its own ancestor or descendant is not projected (a parent declares
and re-exports its children). Any cycle among siblings is an import loop: printed, and the
exit status is 1.

  python3 scripts/module_graph.py src rpc/src simcuda/src     # the crates' src folders
  python3 scripts/module_graph.py --self-test     # it must see the loops it is for
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict
from pathlib import Path

PATH = re.compile(r"\b(crate|super|self)((?:::[A-Za-z_][A-Za-z0-9_]*)+)")
USE_GROUP = re.compile(r"\buse\s+(crate|super|self)((?:::[A-Za-z_][A-Za-z0-9_]*)*)::\{([^;]*)\};", re.S)


def module_of(src: Path, f: Path) -> tuple[str, ...]:
    rel = f.relative_to(src).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] in ("mod", "lib", "main"):
        parts = parts[:-1]
    return tuple(parts)


def strip(text: str) -> str:
    """Drop comments and string literals (paths in docs are not imports)."""
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return re.sub(r'"(?:\\.|[^"\\])*"', '""', text)


def references(text: str) -> list[tuple[str, list[str]]]:
    out = []
    for m in USE_GROUP.finditer(text):
        root, prefix, body = m.group(1), m.group(2), m.group(3)
        base = [p for p in prefix.split("::") if p]
        for item in re.split(r"[,{}]", body):
            item = item.strip().split(" as ")[0].strip()
            if item and item != "self" and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_:]*", item):
                out.append((root, base + [p for p in item.split("::") if p]))
        out.append((root, base))
    for m in PATH.finditer(text):
        out.append((m.group(1), [p for p in m.group(2).split("::") if p]))
    return out


def check(src: Path) -> list[str]:
    files = {module_of(src, f): f for f in src.rglob("*.rs") if "bin" not in f.relative_to(src).parts}
    mods = set(files)
    edges: dict[tuple[str, ...], set] = defaultdict(set)  # parent -> {(a, b)}
    where: dict[tuple, str] = {}
    for mod, f in files.items():
        for root, parts in references(strip(f.read_text())):
            if root == "crate":
                base: tuple[str, ...] = ()
            elif root == "self":
                base = mod
            else:
                # `super` of a file module is its parent module.
                base = mod[:-1] if mod else ()
                while parts and parts[0] == "super":
                    parts = parts[1:]
                    base = base[:-1]
            target = base
            for p in parts:
                if target + (p,) in mods:
                    target = target + (p,)
                else:
                    break
            if target == mod:
                continue
            # Ancestor/descendant edges are not projected.
            n = min(len(mod), len(target))
            if mod[:n] == target[:n]:
                continue
            k = 0
            while mod[k] == target[k]:
                k += 1
            parent, a, b = mod[:k], mod[k], target[k]
            edges[parent].add((a, b))
            where.setdefault((parent, a, b), f"{'::'.join(mod) or 'crate'} -> {'::'.join(target)}")
    loops = []
    for parent, es in edges.items():
        graph = defaultdict(set)
        for a, b in es:
            graph[a].add(b)
        for cycle in cycles(graph):
            steps = [where[(parent, cycle[i], cycle[(i + 1) % len(cycle)])] for i in range(len(cycle))]
            loops.append(f"{src}: {' -> '.join(cycle + [cycle[0]])} (under {'::'.join(parent) or 'crate'}): " + "; ".join(steps))
    return loops


def cycles(graph) -> list[list[str]]:
    """One cycle per strongly connected component with more than one node."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(shortest_cycle(graph, set(comp)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def shortest_cycle(graph, comp) -> list[str]:
    start = min(comp)
    prev, frontier, seen = {start: None}, [start], {start}
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph.get(v, ())):
                if w == start:
                    path = [v]
                    while prev[path[-1]] is not None:
                        path.append(prev[path[-1]])
                    return list(reversed(path))
                if w in comp and w not in seen:
                    seen.add(w)
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return [start]


def self_test() -> int:
    """Small crates with and without loops: each must be judged as expected."""
    import tempfile
    cases = {
        "upward use between siblings": ({"lib.rs": "mod a; mod b;", "a.rs": "use crate::b::X;", "b.rs": "use crate::a::Y;"}, 1),
        "a loop through super inside a folder": (
            {"lib.rs": "mod p;", "p/mod.rs": "mod x; mod y;", "p/x.rs": "use super::y::Y;", "p/y.rs": "fn f() { super::x::g() }"}, 1),
        "a path in an expression": ({"lib.rs": "mod a; mod b;", "a.rs": "fn f() { crate::b::g() }", "b.rs": "use crate::a::{Y, Z};"}, 1),
        "imports going one way": ({"lib.rs": "mod a; mod b;", "a.rs": "use crate::b::X;", "b.rs": "// use crate::a::Y;\nconst S: &str = \"crate::a::Y\";"}, 0),
        "a parent and its child": ({"lib.rs": "mod p;", "p/mod.rs": "mod x; pub use x::X;", "p/x.rs": "use super::Inner;"}, 0),
    }
    bad = 0
    for name, (tree, want) in cases.items():
        with tempfile.TemporaryDirectory() as d:
            for rel, text in tree.items():
                (Path(d) / rel).parent.mkdir(parents=True, exist_ok=True)
                (Path(d) / rel).write_text(text)
            got = 1 if check(Path(d)) else 0
        if got != want:
            print(f"module graph self-test FAILED: {name}: {'a loop' if got else 'no loop'} found")
            bad += 1
    print(f"module graph self-test: {len(cases) - bad} of {len(cases)} cases judged right")
    return 1 if bad else 0


def main(argv: list[str]) -> int:
    if argv[1:] == ["--self-test"]:
        return self_test()
    loops = [l for d in argv[1:] or ["src"] for l in check(Path(d))]
    for l in loops:
        print(f"import loop: {l}")
    if loops:
        return 1
    print(f"module graph: no import loop in {', '.join(argv[1:] or ['src'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
