"""A build killed with SIGKILL at any point never looks complete, and a rerun gives the identical pack."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from expertpack import PackError, load_manifest
from pack_fixtures import write_deepseek4
from packer.builder import PackBuilder, build_pack

TESTS = Path(__file__).resolve().parent
OPTIONS = dict(buffer_bytes=2 * 24576, threads=2)

# The child builds and SIGKILLs itself inside its Nth progress callback: a deterministic
# point, while the worker threads are in the middle of later reads and writes.
CHILD = """
import os, signal, sys
from packer.builder import build_pack
kill_at = int(os.environ["KILL_AT"])
calls = 0
def progress(done, total, rate, eta, phase):
    global calls
    calls += 1
    print(calls, phase, flush=True)
    if calls == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
build_pack(sys.argv[1], sys.argv[2], progress=progress, buffer_bytes=int(sys.argv[3]), threads=2)
print("finished", flush=True)
"""


def files_of(pack: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(pack.iterdir())}


def run_child(src: Path, out: Path, kill_at: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, KILL_AT=str(kill_at), PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS)]))
    return subprocess.run(
        [sys.executable, "-c", CHILD, str(src), str(out), str(OPTIONS["buffer_bytes"])],
        capture_output=True, text=True, env=env, timeout=120,
    )


def assert_not_a_pack(final: Path) -> None:
    partial = final.with_name(final.name + ".partial")
    assert not final.exists(), "a killed build must never leave the final directory"
    assert partial.is_dir()
    with pytest.raises(PackError):
        load_manifest(partial)
    manifest = partial / "manifest.json"
    if manifest.exists():  # only in the instant between marking complete and the rename
        assert json.loads(manifest.read_text())["complete"] is True
        assert not (partial / "progress.json").exists()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("crash")
    src = write_deepseek4(root / "src")
    phases = []
    pack = build_pack(src, root / "ref", progress=lambda *a: phases.append(a[4]), **OPTIONS)
    return src, pack, phases


def kill_points(phases: list[str]) -> dict[str, int]:
    """1-based progress-call numbers at interesting moments of a build."""
    copying = [i for i, p in enumerate(phases, 1) if p.startswith("copying")]
    dense = [i for i, p in enumerate(phases, 1) if p.startswith("writing dense")]
    verify = [i for i, p in enumerate(phases, 1) if p.startswith("verify")]
    return {
        "first-group": copying[0],
        "mid-layer": copying[len(copying) // 2 + 1],
        "last-group": copying[-1],
        "dense": dense[len(dense) // 2],
        "verify": verify[0],
    }


@pytest.mark.parametrize("moment", ["first-group", "mid-layer", "last-group", "dense", "verify"])
def test_sigkill_then_rerun_gives_identical_pack(reference, tmp_path, moment):
    src, ref, phases = reference
    n = kill_points(phases)[moment]
    final = tmp_path / "k.expertpack"
    result = run_child(src, final, n)
    assert result.returncode == -signal.SIGKILL, result.stdout + result.stderr
    assert "finished" not in result.stdout
    assert_not_a_pack(final)
    b = PackBuilder(src, final, **OPTIONS)
    b.run()
    assert not b.stats.restarted
    assert files_of(final) == files_of(ref)
    assert not final.with_name(final.name + ".partial").exists()


def test_killed_twice_including_during_resume(reference, tmp_path):
    src, ref, phases = reference
    final = tmp_path / "k2.expertpack"
    points = kill_points(phases)
    assert run_child(src, final, points["mid-layer"]).returncode == -signal.SIGKILL
    assert_not_a_pack(final)
    second = run_child(src, final, 2)  # dies while re-checking the journaled layers
    assert second.returncode == -signal.SIGKILL
    assert "resume" in second.stdout
    assert_not_a_pack(final)
    build_pack(src, final, **OPTIONS)
    assert files_of(final) == files_of(ref)


def test_killed_between_complete_manifest_and_rename(reference, tmp_path):
    """The last instant: the manifest says complete, the directory is still .partial."""
    src, ref, _ = reference
    final = tmp_path / "k3.expertpack"
    build_pack(src, final, **OPTIONS)
    partial = final.with_name(final.name + ".partial")
    final.rename(partial)
    b = PackBuilder(src, final, **OPTIONS)
    b.run()
    assert b.stats.bytes_copied == 0 and not b.stats.restarted
    assert files_of(final) == files_of(ref)
