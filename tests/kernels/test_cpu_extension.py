"""Builds of the CPU C++ kernels are safe to interrupt (issue 23): a killed build's torch
``lock`` file no longer hangs every later start, a build another process holds is waited
for within a bound that names the lock, and a lock dies with the process that held it."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from kernels import cpu_extension
from kernels.cpu_extension import BuildLockTimeout, LazyExtension, build_extension, build_lock

HOLD = textwrap.dedent("""
    import fcntl, os, sys, time
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    print("held", flush=True)
    time.sleep(600)
""")


def hold_lock(path: Path) -> subprocess.Popen[str]:
    """Another process holding ``path``'s flock (as a build in progress would)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_a_stale_torch_lock_is_removed(tmp_path: Path) -> None:
    (tmp_path / "lock").write_text("")  # left by a build that was killed
    with build_lock(tmp_path, wait_s=1):
        assert not (tmp_path / "lock").exists()


def test_waiting_is_bounded_and_the_lock_dies_with_its_holder(tmp_path: Path) -> None:
    holder = hold_lock(tmp_path / "pagoda.lock")
    try:
        start = time.monotonic()
        with pytest.raises(BuildLockTimeout, match=str(tmp_path / "pagoda.lock")), \
                build_lock(tmp_path, wait_s=0.5):
            pass
        assert time.monotonic() - start < 5
        (tmp_path / "lock").write_text("")  # the holder's torch lock, as it died mid-build
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with build_lock(tmp_path, wait_s=5):  # no one holds it any more
        assert not (tmp_path / "lock").exists()


def test_a_build_held_elsewhere_falls_back_instead_of_hanging(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_extension, "BUILD_WAIT_S", 0.5)
    monkeypatch.setattr(cpu_extension, "build_directory", lambda name: tmp_path)
    monkeypatch.setattr(cpu_extension, "_load", lambda *a: pytest.fail("built while locked"))
    source = tmp_path / "probe.cpp"
    source.write_text(SOURCE)
    holder = hold_lock(tmp_path / "pagoda.lock")
    try:
        extension = LazyExtension("lock probe", lambda: build_extension("probe", source, []))
        start = time.monotonic()
        assert extension.available() is False  # the torch path, with a warning
        assert time.monotonic() - start < 5
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()


SOURCE = """
#include <torch/library.h>
#include <ATen/ATen.h>
static at::Tensor twice(const at::Tensor& x) { return x * 2; }
TORCH_LIBRARY(PAGODA_OP_NS, m) { m.def("twice(Tensor x) -> Tensor", &twice); }
"""


@pytest.mark.slow
def test_a_real_build_after_an_interrupted_one(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's loader with a dead build's lock file in place: built, not hung."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    source = tmp_path / "probe.cpp"
    source.write_text(SOURCE)
    seen: list[Path] = []
    real = cpu_extension.build_directory

    def directory(name: str) -> Path:
        path = real(name)
        path.mkdir(parents=True, exist_ok=True)
        (path / "lock").write_text("")  # an interrupted build's
        seen.append(path)
        return path

    monkeypatch.setattr(cpu_extension, "build_directory", directory)
    build_extension("pagoda_lock_probe", source, [])
    assert seen and seen[0].parent == tmp_path
    x = torch.arange(3.0)
    assert torch.equal(torch.ops.pagoda_lock_probe.twice(x), x * 2)
