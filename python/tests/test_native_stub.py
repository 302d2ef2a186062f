"""The binding's types (python/tensorwire/_native.pyi) and the binding agree: every name
tensorwire._native exports is in the stub and every public name of the stub is exported,
class by class their public members too, and each function's parameter names are the
binding's (its text signature). The type check of the package (mypy) trusts the stub, so
a name or a parameter the stub gets wrong would hide a real mistake."""

import ast
import inspect
from pathlib import Path

import tensorwire
from tensorwire import _native

STUB = Path(tensorwire.__file__).resolve().parent / "_native.pyi"


def public(names):
    return {n for n in names if not n.startswith("_")}


def stub_tree():
    return ast.parse(STUB.read_text(), str(STUB))


def stub_top(tree):
    """Public top-level names of the stub -> their node."""
    out = {}
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            out[node.name] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = node
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    out[t.id] = node
    return {k: v for k, v in out.items() if not k.startswith("_")}


def params(fn: ast.FunctionDef):
    a = fn.args
    names = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]
    return [n for n in names if n not in ("self", "cls")]


def binding_params(obj):
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None  # no text signature (a getter, say): nothing to compare
    return [n for n in sig.parameters if n not in ("self", "cls", "$self", "$type")]


def mismatches(tree=None):
    tree = tree or stub_tree()
    top = stub_top(tree)
    bad = []
    exported = public(dir(_native))
    bad += [f"exported by tensorwire._native, missing from _native.pyi: {n}" for n in sorted(exported - set(top))]
    bad += [f"in _native.pyi, not exported by tensorwire._native: {n}" for n in sorted(set(top) - exported)]
    for name in sorted(set(top) & exported):
        node, obj = top[name], getattr(_native, name)
        if isinstance(node, ast.ClassDef):
            if not isinstance(obj, type):
                bad.append(f"{name}: a class in _native.pyi, a {type(obj).__name__} in the binding")
                continue
            members = {m.name: m for m in node.body if isinstance(m, ast.FunctionDef)}
            have = public(vars(obj))
            bad += [f"{name}.{m}: in the binding, missing from _native.pyi" for m in sorted(have - public(members))]
            bad += [f"{name}.{m}: in _native.pyi, not in the binding" for m in sorted(public(members) - have)]
            if "__new__" in members and binding_params(obj) is not None and params(members["__new__"]) != binding_params(obj):
                bad.append(f"{name}(): parameters {params(members['__new__'])} in _native.pyi, {binding_params(obj)} in the binding")
            for m in sorted(public(members) & have):
                got = binding_params(getattr(obj, m))
                if got is not None and params(members[m]) != got:
                    bad.append(f"{name}.{m}: parameters {params(members[m])} in _native.pyi, {got} in the binding")
        elif isinstance(node, ast.FunctionDef):
            if not callable(obj) or isinstance(obj, type):
                bad.append(f"{name}: a function in _native.pyi, a {type(obj).__name__} in the binding")
                continue
            got = binding_params(obj)
            if got is not None and params(node) != got:
                bad.append(f"{name}: parameters {params(node)} in _native.pyi, {got} in the binding")
    return bad


def test_stub_and_binding_agree():
    assert mismatches() == []


def test_a_name_missing_from_the_stub_is_found():
    # The check itself: the stub less one function, one method and one parameter.
    tree = stub_tree()
    tree.body = [n for n in tree.body if not (isinstance(n, ast.FunctionDef) and n.name == "pool_busy")]
    for n in tree.body:
        if isinstance(n, ast.ClassDef) and n.name == "WorkerHandle":
            n.body = [m for m in n.body if not (isinstance(m, ast.FunctionDef) and m.name == "kill")]
        if isinstance(n, ast.FunctionDef) and n.name == "segment_fd":
            n.args.args = n.args.args[:1]
    found = mismatches(tree)
    assert "exported by tensorwire._native, missing from _native.pyi: pool_busy" in found
    assert "WorkerHandle.kill: in the binding, missing from _native.pyi" in found
    assert any(f.startswith("segment_fd: parameters") for f in found)
