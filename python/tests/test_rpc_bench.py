"""``python -m tensorwire bench rpc --quick --no-plot`` runs end to end in a subprocess
(real worker processes for every system) and prints every row of its tables: the calls,
and noop() alone and beside busy processes."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

PAYLOADS = ["add(1, 2)", "4 KiB tensor", "64 MiB tensor", "JSON 1,000 leaves", "JSON dict 333 keys",
            "1 KiB randn echo", "4 KiB randn echo", "64 MiB randn echo"]


def _importable(name: str) -> bool:
    try:
        __import__(name)
    except ImportError:
        return False
    return True


HAVE_PYISOLATE = _importable("pyisolate")
CELL = r"\s*[0-9][0-9,.]* / [0-9][0-9,.]*\s*"  # "p50 / p90"


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    work = tmp_path_factory.mktemp("bench-rpc")
    r = subprocess.run([sys.executable, "-m", "tensorwire", "bench", "rpc", "--quick", "--no-plot"],
                       cwd=work, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    assert not list(work.iterdir()), "--no-plot wrote a file"
    return r


CONTENTION_HEADER = "contention "


def calls_table(stdout: str) -> str:
    return stdout.split(f"\n{CONTENTION_HEADER}", 1)[0]


def contention_table(stdout: str) -> str:
    parts = stdout.split(f"\n{CONTENTION_HEADER}", 1)
    assert len(parts) == 2, f"no contention table in:\n{stdout}"
    return CONTENTION_HEADER + parts[1]


def row(stdout: str, name: str) -> str:
    rows = [line for line in calls_table(stdout).splitlines() if line.startswith(f"{name} ") and "|" in line]
    assert len(rows) == 1, f"no single row {name!r} in:\n{stdout}"
    return rows[0]


def check_measured(stdout: str, name: str) -> None:
    cells = row(stdout, name).split("|")[1:]
    assert len(cells) == len(PAYLOADS) + 2, row(stdout, name)
    for payload, c in zip(PAYLOADS, cells):
        assert re.fullmatch(CELL, c), f"{name}, {payload}: {c!r}\n{stdout}"
    assert re.fullmatch(r"\s*[0-9][0-9,]* ms\s*", cells[len(PAYLOADS)]), f"{name} cold start: {cells[-2]!r}\n{stdout}"


def test_header_names_every_payload(bench):
    header = next(line for line in bench.stdout.splitlines() if line.strip().startswith("|"))
    for p in PAYLOADS:
        assert p in header, header
    assert "cold start" in header and "warm pool get" in header, header
    assert "bench: " in bench.stderr  # progress went to stderr
    assert "error" not in bench.stdout, bench.stdout


@pytest.mark.parametrize("name", ["tensorwire.rpc", "ProcessPool", "mp.Pipe"])
def test_row_measured(bench, name):
    check_measured(bench.stdout, name)


def test_tensorwire_warm_pool_hand_out(bench):
    assert re.fullmatch(r"\s*[0-9][0-9,.]* µs\s*", row(bench.stdout, "tensorwire.rpc").split("|")[-1]), bench.stdout
    assert "warm worker handed out in" in bench.stdout, bench.stdout


def test_tensorwire_start_from_the_zygote(bench):
    assert re.search(r"worker start from the zygote \(torch imported\): [0-9.]+ ms p50", bench.stdout), bench.stdout
    import tensorwire.rpc as rpc
    if rpc._native.containment()["user_namespaces"]:
        assert re.search(r"sandboxed worker start from the zygote: [0-9.]+ ms p50", bench.stdout), bench.stdout


def test_pyisolate_row_and_ratios(bench):
    if not HAVE_PYISOLATE:
        assert "pyisolate row SKIPPED" in bench.stderr and "not run:" in row(bench.stdout, "pyisolate")
        pytest.skip("pyisolate is not importable: the bench's pyisolate row was NOT measured "
                    "(pip install pyisolate==0.10.2, or scripts/setup-venv.sh)")
    check_measured(bench.stdout, "pyisolate")
    ratios = next(line for line in bench.stdout.splitlines() if line.startswith("pyisolate / tensorwire.rpc"))
    for p in PAYLOADS:
        assert re.search(re.escape(p) + r" [0-9.]+x", ratios), ratios


@pytest.mark.parametrize("name", ["tensorwire.rpc", "torch.mp Pipe", "pyisolate"])
def test_contention_row_measured(bench, name):
    table = contention_table(bench.stdout)
    header = table.splitlines()[0]
    assert "alone" in header and "busy processes" in header, header
    rows = [line for line in table.splitlines() if line.startswith(f"{name} ") and "|" in line]
    assert len(rows) == 1, f"no single contention row {name!r} in:\n{table}"
    if name == "pyisolate" and not HAVE_PYISOLATE:
        assert "not run:" in rows[0]
        pytest.skip("pyisolate is not importable: its contention row was NOT measured")
    cells = rows[0].split("|")[1:]
    assert len(cells) == 2 and all(re.fullmatch(CELL, c) for c in cells), rows[0]
    assert "noop" in bench.stderr and "busy" in bench.stderr  # its progress went to stderr
    assert "tensorwire.rpc / torch.mp Pipe: p50" in table, table


def test_randn_echoes_have_a_pipe_bytes_baseline_and_goals(bench):
    cells = row(bench.stdout, "Pipe bytes").split("|")[1:]
    for payload, c in zip(PAYLOADS, cells):
        if payload in ("1 KiB randn echo", "4 KiB randn echo"):
            assert re.fullmatch(CELL, c), f"Pipe bytes, {payload}: {c!r}\n{bench.stdout}"
    for p in ("1 KiB randn echo: ", "4 KiB randn echo: ", "64 MiB randn echo: "):
        assert p in bench.stdout, bench.stdout
