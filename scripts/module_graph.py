#!/usr/bin/env python3
"""Import loops between modules of a Rust crate: the check that keeps imports going one way.

A crate's modules are found from its root file by following its `mod name;` declarations
(with their `#[path]` attributes), as rustc does. For each module file it collects the paths
it names (`crate::a::b`, `super::x`, `self::y`, in `use` items and in expressions), resolves
each to the deepest module it reaches, and projects every edge onto the siblings under the
two modules' lowest common ancestor (`peer::import -> peer::cuda_import` is an edge between
siblings of `peer`; `error -> ring::spsc` one between the top-level modules `error` and
`ring`). An edge between a module and its own ancestor or descendant is not projected (a
parent declares and re-exports its children). Any cycle among siblings is an import loop:
printed, and the exit status is 1.

  python3 scripts/module_graph.py --workspace     # every target of every crate cargo knows
  python3 scripts/module_graph.py src rpc/src     # crates by folder (lib.rs or main.rs) or root file
  python3 scripts/module_graph.py --self-test     # it must see the loops it is for

`--workspace` asks `cargo metadata --no-deps` for the workspace's packages and checks the
root file of each of their targets (libraries, binaries, tests, examples, benches, build
scripts), then does the same for each workspace its `exclude` list names (fuzz/), so a new
crate or target is checked without being listed anywhere.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import tomllib
from collections import defaultdict
from collections.abc import Callable
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


MOD_DECL = re.compile(
    r'((?:#\[[^\]]*\]\s*)*)(?:pub(?:\s*\([^)]*\))?\s+)?mod\s+([A-Za-z_][A-Za-z0-9_]*)\s*;')
PATH_ATTR = re.compile(r'#\[path\s*=\s*"([^"]*)"\s*\]')


def strip_keep_paths(text: str) -> str:
    """Drop comments only (a `#[path = "..."]` attribute's string is needed)."""
    text = re.sub(r"//[^\n]*", "", text)
    return re.sub(r"/\*.*?\*/", "", text, flags=re.S)


def modules(root: Path) -> dict[tuple[str, ...], Path]:
    """The crate's module files, from its root file along its `mod name;` declarations.

    A file module's children live in its own folder when it is the crate root or a
    `mod.rs` (`dir/x.rs` or `dir/x/mod.rs`), else in the folder named after it; a
    `#[path]` attribute names the file relative to the declaring file's folder.
    """
    found: dict[tuple[str, ...], Path] = {(): root}
    todo = [((), root, True)]
    while todo:
        mod, f, mod_rs = todo.pop()
        for m in MOD_DECL.finditer(strip_keep_paths(f.read_text())):
            attrs, name = m.group(1), m.group(2)
            p = PATH_ATTR.search(attrs)
            if p:
                child = (f.parent / p.group(1)).resolve()
                child_mod_rs = child.name == "mod.rs"
            else:
                d = f.parent if mod_rs else f.parent / f.stem
                child = d / f"{name}.rs"
                child_mod_rs = False
                if not child.exists():
                    child, child_mod_rs = d / name / "mod.rs", True
            if child.exists() and mod + (name,) not in found:
                found[mod + (name,)] = child
                todo.append((mod + (name,), child, child_mod_rs))
    return found


def crate_root(src: Path) -> Path:
    if src.is_file():
        return src
    for name in ("lib.rs", "main.rs"):
        if (src / name).exists():
            return src / name
    raise SystemExit(f"module graph: {src} has no lib.rs or main.rs; name the crate's root file instead")


def check(src: Path) -> list[str]:
    files = modules(crate_root(src))
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
            loops.append(f"{crate_root(src)}: {' -> '.join(cycle + [cycle[0]])} (under {'::'.join(parent) or 'crate'}): " + "; ".join(steps))
    return loops


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One shortest cycle per strongly connected component with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(shortest_cycle(graph, comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def shortest_cycle(graph: dict[str, set[str]], comp: set[str]) -> list[str]:
    start = min(comp)
    prev: dict[str, str | None] = {start: None}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph.get(v, ())):
                if w == start:
                    path = [v]
                    while prev[path[-1]] is not None:
                        path.append(prev[path[-1]])  # type: ignore[arg-type]
                    return list(reversed(path))
                if w in comp and w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return [start]


def write_tree(root: Path, tree: dict[str, str]) -> None:
    """Write each file of `tree` (path relative to `root` -> text) under `root`."""
    for rel, text in tree.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def misjudged(what: str, cases: dict[str, tuple[dict[str, str], int]],
              loops_in: Callable[[Path], list[str]]) -> int:
    """How many of `cases` (name -> (its files, 1 where a loop must be found, else 0))
    `loops_in` judges wrong, given a temporary folder holding the case's files; each wrong
    one is printed (`what` names the check). Both checks' self-tests run their cases here."""
    bad = 0
    for name, (tree, want) in cases.items():
        with tempfile.TemporaryDirectory() as d:
            write_tree(Path(d), tree)
            loops = loops_in(Path(d))
        got = 1 if loops else 0
        if got != want:
            print(f"{what} self-test FAILED: {name}: {'a loop' if got else 'no loop'} found {loops}")
            bad += 1
    return bad


def self_test() -> int:
    """Small crates with and without loops: each must be judged as expected."""
    cases = {
        "upward use between siblings": ({"lib.rs": "mod a; mod b;", "a.rs": "use crate::b::X;", "b.rs": "use crate::a::Y;"}, 1),
        "a loop through super inside a folder": (
            {"lib.rs": "mod p;", "p/mod.rs": "mod x; mod y;", "p/x.rs": "use super::y::Y;", "p/y.rs": "fn f() { super::x::g() }"}, 1),
        "a path in an expression": ({"lib.rs": "mod a; mod b;", "a.rs": "fn f() { crate::b::g() }", "b.rs": "use crate::a::{Y, Z};"}, 1),
        "imports going one way": ({"lib.rs": "mod a; mod b;", "a.rs": "use crate::b::X;", "b.rs": "// use crate::a::Y;\nconst S: &str = \"crate::a::Y\";"}, 0),
        "a parent and its child": ({"lib.rs": "mod p;", "p/mod.rs": "mod x; pub use x::X;", "p/x.rs": "use super::Inner;"}, 0),
        "children in the folder of a non-mod.rs file": (
            {"lib.rs": "mod p;", "p.rs": "mod x; mod y;", "p/x.rs": "use super::y::Y;", "p/y.rs": "use super::x::X;"}, 1),
        "a #[path] module": (
            {"lib.rs": "mod a;\n#[path = \"other/b_impl.rs\"]\nmod b;", "a.rs": "use crate::b::X;", "other/b_impl.rs": "use crate::a::Y;"}, 1),
        "a file no `mod` declares is not part of the crate": (
            {"lib.rs": "mod a;", "a.rs": "use crate::b::X;", "b.rs": "use crate::a::Y;"}, 0),
    }
    bad = misjudged("module graph", cases, check)
    # `--workspace`: a loop in a member crate, in a binary target's modules and in a crate of
    # an excluded workspace must each be found without naming them.
    ws = {
        "Cargo.toml": '[workspace]\nmembers = [".", "inner"]\nexclude = ["apart"]\n'
                      '[package]\nname = "top"\nversion = "0.0.0"\nedition = "2021"\n',
        "src/lib.rs": "",
        "inner/Cargo.toml": '[package]\nname = "inner"\nversion = "0.0.0"\nedition = "2021"\n',
        "inner/src/lib.rs": "mod a; mod b;", "inner/src/a.rs": "use crate::b::X;", "inner/src/b.rs": "use crate::a::Y;",
        "src/bin/tool/main.rs": "mod c; mod d;", "src/bin/tool/c.rs": "use crate::d::X;", "src/bin/tool/d.rs": "use crate::c::Y;",
        "apart/Cargo.toml": '[package]\nname = "apart"\nversion = "0.0.0"\nedition = "2021"\n[workspace]\n',
        "apart/src/lib.rs": "mod e; mod f;", "apart/src/e.rs": "use crate::f::X;", "apart/src/f.rs": "use crate::e::Y;",
    }
    with tempfile.TemporaryDirectory() as d:
        write_tree(Path(d), ws)
        loops = [l for r in workspace_roots(Path(d) / "Cargo.toml") for l in check(r)]
    for want in ("a -> b -> a", "c -> d -> c", "e -> f -> e"):
        if not any(want in l for l in loops):
            print(f"module graph self-test FAILED: --workspace missed the loop {want}")
            bad += 1
    total = len(cases) + 3
    print(f"module graph self-test: {total - bad} of {total} cases judged right")
    return 1 if bad else 0


def workspace_roots(manifest: Path) -> list[Path]:
    """The root file of every target of every package of the workspace at `manifest`, and
    of the workspaces its `[workspace] exclude` list names (each its own workspace), but
    for what stands under vendor/: others' crates, kept as published, are not ours to
    reshape."""
    out = subprocess.run(
        ["cargo", "metadata", "--no-deps", "--format-version", "1", "--manifest-path", str(manifest)],
        check=True, capture_output=True, text=True).stdout
    meta = json.loads(out)
    roots = {Path(t["src_path"]) for p in meta["packages"] for t in p["targets"]}
    with open(manifest, "rb") as f:
        excluded = tomllib.load(f).get("workspace", {}).get("exclude", [])
    for e in excluded:
        if Path(e).parts[:1] == ("vendor",):
            continue
        if (manifest.parent / e / "Cargo.toml").exists():
            roots.update(workspace_roots(manifest.parent / e / "Cargo.toml"))
    return sorted(roots)


def main(argv: list[str]) -> int:
    if argv[1:] == ["--self-test"]:
        return self_test()
    if argv[1:] == ["--workspace"]:
        roots = [r.relative_to(Path.cwd()) if r.is_relative_to(Path.cwd()) else r
                 for r in workspace_roots(Path.cwd() / "Cargo.toml")]
        what = f"the {len(roots)} crate roots of the workspace (cargo metadata)"
    else:
        roots = [Path(d) for d in argv[1:] or ["src"]]
        what = ", ".join(argv[1:] or ["src"])
    loops = list(dict.fromkeys(l for r in roots for l in check(r)))  # shared modules once
    for l in loops:
        print(f"import loop: {l}")
    if loops:
        return 1
    print(f"module graph: no import loop in {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
