"""The escape suite from Python: hostile code in a sandboxed ``tensorwire.spawn`` worker
(``escape_probe.Probe``) tries every class of attack of DESIGN's containment table, and
each must be refused or contained — as root and, from root, with the host running as an
unprivileged user. The same attacks from an unsandboxed worker succeed (so each refusal
is the sandbox's), and the same probe inside bubblewrap (``bwrap --unshare-all
--die-with-parent --new-session --clearenv``) escapes at least wherever ours does."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

import tensorwire
import tensorwire.rpc as rpc

HERE = str(Path(__file__).resolve().parent)
SECRET = "TW_CONTAIN_TEST_SECRET"
LEAKED_FD = 900
ROOT = os.geteuid() == 0

pytestmark = pytest.mark.skipif(not tensorwire.rpc._native.containment()["user_namespaces"],
                                reason="this machine refuses user namespaces: the escape suite needs them")


class Targets:
    """What the attacks aim at: a sacrificial process, Unix sockets by path and abstract
    name, a TCP port, an inheritable fd, a secret in the environment, a file beside us."""

    def __enter__(self) -> "Targets":
        self.victim = subprocess.Popen(["sleep", "120"])
        tag = f"tw-contain-py-{os.getpid()}-{self.victim.pid}"
        self.dir = tempfile.mkdtemp(prefix="tw-contain-")
        self.path = os.path.join(self.dir, "agent.sock")
        self.unix = socket.socket(socket.AF_UNIX)
        self.unix.bind(self.path)
        self.unix.listen()
        self.abstract = socket.socket(socket.AF_UNIX)
        self.abstract.bind("\0" + tag)
        self.abstract.listen()
        self.tcp = socket.create_server(("127.0.0.1", 0))
        fd = os.open("/dev/null", os.O_RDONLY)
        os.dup2(fd, LEAKED_FD, inheritable=True)
        os.close(fd)
        os.environ[SECRET] = "hunter2"
        self.beside = os.path.join(self.dir, "host-config.toml")
        Path(self.beside).write_text("token = 'not for workers'\n")
        self.json = {"path": self.path, "abstract": tag, "port": self.tcp.getsockname()[1], "victim": self.victim.pid,
                     "secret": SECRET, "fd": LEAKED_FD, "beside": self.beside, "dirs": [self.dir]}
        return self

    def victim_untouched(self) -> str:
        fields = Path(f"/proc/{self.victim.pid}/stat").read_text().rsplit(")", 1)[1].split()
        state, nice = fields[0], int(fields[16])
        # The victim starts at this process's niceness (a test run under `nice` too).
        ours = os.getpriority(os.PRIO_PROCESS, 0)
        return f"refused: sleeping, nice {ours}" if state == "S" and nice == ours else f"escaped: state {state}, nice {nice}"

    def __exit__(self, *exc) -> None:
        self.victim.kill()
        self.victim.wait()
        os.close(LEAKED_FD)
        os.environ.pop(SECRET, None)
        for s in (self.unix, self.abstract, self.tcp):
            s.close()
        shutil.rmtree(self.dir)


def spawn(sandbox=None, **kw):
    # The probe sits in this directory: named explicitly, as every target's directory is.
    return rpc.spawn("escape_probe:Probe", path=[HERE], sandbox=sandbox, output="capture", timeout=60.0, **kw)


def attack_all(w, t: Targets) -> dict[str, str]:
    import escape_probe

    out = {what: w.call(m, *args) for what, m, args in escape_probe.attacks(t.json)}
    out["the victim afterwards"] = t.victim_untouched()
    return out


def escaped(results: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in results.items() if not v.startswith("refused")}


def suite(zygote: bool = False) -> dict[str, str]:
    """Every attack from a sandboxed worker (exec'd, or forked from a zygote that
    imported torch); the worker is pid 1 of its own namespace."""
    # The worker starts in the directory that holds the host's file, as a host script's
    # worker does: neither is on its import path nor readable.
    with Targets() as t, spawn(rpc.Sandbox(), cwd=t.dir, zygote=zygote) as w:
        assert w.call("pid") == 1
        return attack_all(w, t)


sys.path.insert(0, HERE)


def test_every_attack_from_a_sandboxed_worker_forked_by_a_zygote_is_refused():
    # The zygote ran torch's imports with the host's allow-listed environment; the worker
    # it forks is contained before its Python runs again (no exec strips anything).
    results = suite(zygote=True)
    for name, outcome in results.items():
        print(f"{name:40} {outcome}")
    assert escaped(results) == {}


def test_every_attack_from_a_sandboxed_worker_is_refused():
    results = suite()
    for what, o in results.items():
        print(f"{what:40} {o}")
    assert escaped(results) == {}


def test_the_same_attacks_from_an_unsandboxed_worker_succeed():
    with Targets() as t, spawn(cwd=t.dir) as w:
        got = escaped(attack_all(w, t))
    for must in ("unix socket by path", "unix socket by abstract name", "tcp to the host", "SIGSTOP another process",
                 "the host's environment", "an inherited fd", "a file beside the host", "clone3"):
        assert must in got, f"{must} should succeed from an unsandboxed worker: {got}"


def _named(name: str) -> list[int]:
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                if Path(f"/proc/{p}/comm").read_text().strip() == name:
                    out.append(int(p))
            except OSError:
                pass
    return out


@pytest.mark.parametrize("how", ["close", "kill", "deadline", "exit"])
def test_nothing_a_sandboxed_worker_started_outlives_it(how):
    name = f"twpy{how[:3]}{os.getpid() % 10000}"
    w = spawn(rpc.Sandbox())
    try:
        assert w.call("escapee", name) == "started"
        by = time.monotonic() + 10
        while not _named(name):
            assert time.monotonic() < by, "the escapee never started"
            time.sleep(0.01)
        if how == "close":
            w.close()
        elif how == "kill":
            w.kill()
        elif how == "deadline":
            with pytest.raises(tensorwire.Timeout):
                w.call("sleep", 30, timeout=0.5)
        else:
            with pytest.raises(tensorwire.PeerGone):
                w.call("exit")
        assert _named(name) == [], f"a descendant of the worker outlived its end by {how}"
    finally:
        w.close()


def test_a_sandboxed_worker_gets_only_the_allow_listed_environment_and_what_spawn_names():
    names, prefixes = rpc.KEPT_ENV
    assert "PATH" in names and "LC_" in prefixes and SECRET not in names
    with Targets(), spawn(rpc.Sandbox(), env={"MY_SETTING": "on"}) as w:
        assert w.call("env", SECRET) == "refused: not set"
        assert w.call("env", "MY_SETTING") == "escaped: on"


def test_tensors_still_flow_through_a_sandboxed_worker():
    with rpc.spawn("rpc_targets:Plugin", path=[HERE], sandbox=rpc.Sandbox(), timeout=60.0) as w:
        x = torch.randn(1000)
        assert torch.equal(w.call("scale", x, 2.0), x * 2.0)
        assert bool((w.call("fill", 1 << 16, 1.0) == 1.0).all())


def test_the_worker_import_path_is_explicit():
    # Without path=[...], the directory of the host (and the cwd) is not importable.
    with pytest.raises(tensorwire.PeerGone, match="cannot load"):
        rpc.spawn("escape_probe:Probe", output="capture", cwd=HERE, handshake_timeout=60.0)


HOST = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import test_containment as t
print("RESULTS " + json.dumps(t.suite()))
"""


def closed_ancestor(path: str):
    """The outermost directory above ``path`` that other users cannot enter (a root-owned
    pyenv under a 0700 ``/root``), or None."""
    parts = Path(path).resolve().parts
    for i in range(2, len(parts)):
        d = Path(*parts[:i])
        if not d.stat().st_mode & 0o001:
            return str(d)
    return None


# Run as root in a private mount namespace: a 0755 tmpfs over the closed directory ($1)
# that shows only the interpreter's prefix ($2, relative to it) from the real one, kept
# at $3; then the command.
UNCLOSE = ('set -e; mount --bind "$1" "$3"; mount -t tmpfs -o mode=755 tmpfs "$1"; mkdir -p "$1/$2"; '
           'mount --bind "$3/$2" "$1/$2"; shift 3; exec "$@"')


def as_user(uid: int, argv: list, scratch: str) -> list:
    """``argv`` as ``uid`` (and its group), able to run this interpreter: where it lives
    below a directory others cannot enter, in a private mount namespace that opens just
    the interpreter's prefix there (nothing of the host's view changes)."""
    cmd = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *argv]
    prefix = os.path.realpath(sys.base_prefix)
    closed = closed_ancestor(prefix)
    if closed is None:
        return cmd
    keep = tempfile.mkdtemp(prefix=".real-", dir=scratch)
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", UNCLOSE, "sh", closed,
            os.path.relpath(prefix, closed), keep, *cmd]


@pytest.mark.skipif(not ROOT, reason="runs the host as another user, which needs root; this run is unprivileged already")
def test_an_unprivileged_host_gets_the_same_containment():
    nobody = 65534
    home = tempfile.mkdtemp(prefix="tw-nobody-")
    os.chown(home, nobody, nobody)
    try:
        env = {k: v for k, v in os.environ.items() if k != SECRET}
        env["HOME"] = home
        # The host runs from its own directory: the import path as this process sees it.
        env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)
        check = subprocess.run(as_user(nobody, [sys.executable, "-c", "import tensorwire"], home), env=env, cwd=home,
                               capture_output=True, text=True, timeout=120)
        assert check.returncode == 0, f"uid {nobody} cannot import tensorwire with this interpreter:\n{check.stderr}"
        r = subprocess.run(as_user(nobody, [sys.executable, "-c", HOST, HERE], home), env=env, cwd=home,
                           capture_output=True, text=True, timeout=300)
        line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULTS ")]
        assert r.returncode == 0 and line, f"the unprivileged host failed:\n{r.stdout}\n{r.stderr}"
        results = json.loads(line[0][len("RESULTS "):])
        assert escaped(results) == {}
    finally:
        shutil.rmtree(home)


BWRAP = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--clearenv", "--ro-bind", "/", "/", "--dev", "/dev",
         "--proc", "/proc"]


def test_bubblewrap_lets_through_whatever_we_let_through():
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        pytest.skip("bubblewrap is not installed (scripts/test.sh installs Debian's package)")
    ours = escaped(suite())
    with Targets() as t:
        r = subprocess.run(BWRAP + ["--", sys.executable, os.path.join(HERE, "escape_probe.py"), json.dumps(t.json)],
                           capture_output=True, text=True, timeout=120, pass_fds=(LEAKED_FD,))
        assert r.returncode == 0, r.stderr
        theirs = escaped(json.loads(r.stdout))
        theirs_victim = t.victim_untouched()
    print("bubblewrap lets through:", json.dumps(theirs, indent=1), "victim:", theirs_victim)
    assert set(ours) <= set(theirs), f"escapes ours gives and bubblewrap does not: {set(ours) - set(theirs)}"


@pytest.mark.skipif(not ROOT, reason="bubblewrap's --disable-userns needs a user namespace bwrap makes; run as root here")
def test_a_machine_without_user_namespaces_is_a_named_error_never_a_weaker_worker():
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        pytest.skip("bubblewrap is not installed (scripts/test.sh installs Debian's package)")
    host = ("import sys; sys.path.insert(0, sys.argv[1]); import tensorwire, tensorwire.rpc as rpc\n"
            "try:\n    rpc.spawn('escape_probe:Probe', path=[sys.argv[1]], sandbox=rpc.Sandbox())\n"
            "except tensorwire.Refused as e:\n    print('REFUSED', e)\n")
    r = subprocess.run(["bwrap", "--unshare-user", "--disable-userns", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
                        "--", sys.executable, "-c", host, HERE], capture_output=True, text=True, timeout=120)
    assert "REFUSED" in r.stdout and "user namespaces" in r.stdout, r.stdout + r.stderr
