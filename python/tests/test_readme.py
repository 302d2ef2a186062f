"""Every README example runs as written: each ```python block as a script, and the
commands of the Python quick start that run the package (``python -c``, ``python -m
tensorwire ...``), each in a fresh directory. (Its Rust examples are doctests and its C
examples are compiled by tests/readme.rs; the install commands are what scripts/test.sh
runs to install the package it tests, with pip and with uv.)"""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def blocks(lang):
    """(line, body) of each ```lang block of the README."""
    text = README.read_text()
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1))
            for m in re.finditer(rf"^```{lang}\n(.*?)^```$", text, re.MULTILINE | re.DOTALL)]


def _python_blocks():
    return [pytest.param(body, id=f"line{line}") for line, body in blocks("python")]


@pytest.mark.parametrize("body", _python_blocks())
def test_python_example_runs_as_written(body, tmp_path):
    if "import pyisolate" in body:
        pytest.importorskip("pyisolate", reason="pyisolate is not installed: SKIPPED (scripts/setup-venv.sh installs it)")
    (tmp_path / "scripts").mkdir()
    script = tmp_path / "scripts" / "example.py"
    script.write_text(body)
    # From another directory than the script's: a worker's import path is explicit.
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    assert "Traceback" not in r.stderr, r.stderr


def _run_commands():
    """The quick start's commands that run the installed package (lines starting with
    ``python``), without their trailing comments."""
    cmds = []
    for _, body in blocks("sh"):
        for line in body.splitlines():
            if line.startswith("python "):
                cmds.append(shlex.split(line, comments=True))
    return cmds


def test_the_quick_start_lists_what_it_runs():
    cmds = [" ".join(c[1:3]) for c in _run_commands()]
    assert cmds == ["-c import tensorwire; print(tensorwire.__version__)", "-m tensorwire", "-m tensorwire",
                    "-m tensorwire"], cmds
    sh = "\n".join(body for _, body in blocks("sh"))
    # Both kinds of venv: pip's, and uv's (which has no pip).
    # The wheel built once, then installed as scripts/test.sh installs it (no compiler);
    # or a source install in one step.
    assert "\nmaturin build --release --zig --compatibility manylinux_2_28 -o dist" in "\n" + sh
    for tool in ("pip", "uv pip"):
        assert f"\n{tool} install dist/tensorwire-*.whl" in "\n" + sh
        assert f"\n{tool} install ." in "\n" + sh


@pytest.fixture
def no_matplotlib(tmp_path):
    """An environment where ``import matplotlib`` fails, as in a venv without it."""
    stub = tmp_path / "stub"
    (stub / "matplotlib").mkdir(parents=True)
    (stub / "matplotlib" / "__init__.py").write_text("raise ImportError('matplotlib is not installed (test stub)')\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(stub), env.get("PYTHONPATH")]))
    return env


@pytest.mark.parametrize("cmd", _run_commands(), ids=lambda c: " ".join(c[1:4]))
def test_quick_start_command_runs_as_written(cmd, tmp_path, no_matplotlib):
    # bench runs without matplotlib: the table is the result, the plot optional.
    env = no_matplotlib if cmd[1:] == ["-m", "tensorwire", "bench"] else None
    work = tmp_path / "work"
    work.mkdir()
    r = subprocess.run([sys.executable, *cmd[1:]], cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{cmd}: exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    if cmd[1:] == ["-m", "tensorwire", "bench"]:
        assert "torch.mp/tw" in r.stdout and "1 GiB |" in r.stdout, r.stdout
        assert "plot: skipped, matplotlib is not installed" in r.stdout, r.stdout
        assert not list(work.iterdir())  # no PNG without matplotlib
        # Nothing that speaks of the project's own targets in what a user sees.
        assert not re.search(r"target|NOT met|\bmet\)", r.stdout + r.stderr), r.stdout


def test_bench_table_only(tmp_path):
    r = subprocess.run([sys.executable, "-m", "tensorwire", "bench", "--max-size", "4096", "--iters", "5", "--no-plot"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "4 KiB |" in r.stdout and "plot" not in r.stdout and not list(tmp_path.iterdir()), r.stdout
