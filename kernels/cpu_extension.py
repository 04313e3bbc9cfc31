"""How the CPU C++ kernels (``cpu_decode``, ``cpu_fused``) are built and loaded.

Each is a torch op library compiled on first use with ``load_inline`` and
``-march=native`` (the machine that builds it runs it) into the torch extensions cache
(``TORCH_EXTENSIONS_DIR``). The extension name carries a hash of its sources, flags,
torch version and CPU flags, so any change rebuilds. ``LazyExtension`` builds once per
process and reports whether that worked, so callers can keep their torch path.

Builds are safe to interrupt. torch serialises builds of one extension with a ``lock``
file in its build directory that a killed build leaves behind, after which every later
load waits for it forever. So a build first takes an ``flock`` on ``pagoda.lock`` beside
it, which the kernel drops when its holder dies: whoever holds that lock is the only one
building, so a torch ``lock`` file found then is stale and removed. Waiting for another
process's build is bounded (``BUILD_WAIT_S``) and names the lock; past it the build fails,
and the caller runs its torch path with a warning instead of hanging.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SCALAR_HEADER = CSRC / "cpu_scalar.h"  # the conversions and exp every kernel includes
# no -ffast-math: IEEE semantics (NaN, summation order as written) in every loop
_CFLAGS = ["-O3", "-march=native", "-std=c++17"]
BUILD_WAIT_S = 900.0  # for another process's build of the same extension (a cold one: ~1 min)
_POLL_S = 0.2


class BuildLockTimeout(TimeoutError):
    """Another process held an extension's build lock for longer than the wait allows."""


def build_directory(name: str) -> Path:
    """Where torch builds extension ``name`` (``TORCH_EXTENSIONS_DIR`` or its default)."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False))


@contextlib.contextmanager
def build_lock(directory: Path, wait_s: float | None = None) -> Iterator[None]:
    """Hold ``directory/pagoda.lock`` (an flock: released when the holder dies, however it
    dies) for up to ``wait_s`` (default ``BUILD_WAIT_S``); torch's own ``lock`` file found
    while holding it is a dead build's, removed."""
    wait_s = BUILD_WAIT_S if wait_s is None else wait_s
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "pagoda.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + wait_s
        warned = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise BuildLockTimeout(
                        f"another process has been building in {directory} for over "
                        f"{wait_s:.0f} s (lock {path})") from None
                if not warned:
                    logger.info("waiting for another process's build (lock %s)", path)
                    warned = True
                time.sleep(_POLL_S)  # flock has no timed wait; poll the lock's state
        stale = directory / "lock"
        if stale.exists():
            logger.warning("removing %s, left by an interrupted build", stale)
            stale.unlink(missing_ok=True)
        yield
    finally:
        os.close(fd)  # drops the flock


def _openmp_flags() -> tuple[list[str], list[str]]:  # compile flags, link flags
    """Flags that put at::parallel_for on torch's own thread pool.

    Under torch's OpenMP backend, ATen inlines parallel_for from its headers as an
    ``omp parallel`` region: without -fopenmp it would run on one thread, and linked
    against another OpenMP runtime than the one torch loaded it would start a second
    pool. So link the runtime file this process has mapped. Other backends need only
    ``omp simd``.
    """
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return ["-fopenmp-simd"], []
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        maps = []
    for line in maps:
        path = line.split()[-1]
        if re.search(r"/lib[gi]omp[^/]*\.so", path):
            return ["-fopenmp"], [path]
    return ["-fopenmp"], ["-fopenmp"]  # not found: the compiler's runtime, same soname hoped


def _host_tag() -> str:
    """What the binary depends on besides its source: torch's ABI and the CPU (-march=native)."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        flags = next((ln for ln in cpuinfo.splitlines() if ln.startswith("flags")), "")
    except OSError:
        flags = platform.processor()
    return f"{torch.__version__} {platform.machine()} {flags}"


def build_extension(
    namespace: str, source_file: Path, header_files: Sequence[Path], *,
    extra_cflags: Sequence[str] = (), defines: Sequence[str] = (),
) -> None:
    """Compile (or load from the cache) ``source_file`` as ``torch.ops.<namespace>``.

    The source registers its ops under the ``PAGODA_OP_NS`` macro, set to ``namespace``;
    a variant (``defines``, extra ``-D`` flags) needs its own namespace, as a namespace
    registers once per process. ``header_files`` are the headers it includes from
    ``csrc/``: part of the cache key, so an edit rebuilds.
    """
    source = source_file.read_text()
    headers = [h.read_text() for h in header_files]
    omp_cflags, ldflags = _openmp_flags()
    cflags = [*_CFLAGS, *extra_cflags, *omp_cflags, f"-DPAGODA_OP_NS={namespace}",
              *(f"-D{d}" for d in defines)]
    key = "\n".join([source, *headers, *cflags, *ldflags, _host_tag()])
    name = f"{namespace}_{hashlib.sha256(key.encode()).hexdigest()[:10]}"
    start = time.perf_counter()
    with build_lock(build_directory(name)):
        _load(name, source, cflags, ldflags)
    logger.info("%s extension ready in %.1f s", namespace, time.perf_counter() - start)


def _load(name: str, source: str, cflags: list[str], ldflags: list[str]) -> None:
    from torch.utils.cpp_extension import load_inline

    load_inline(
        name=name,
        cpp_sources=[source],
        extra_cflags=cflags,
        extra_ldflags=ldflags,
        extra_include_paths=[str(CSRC)],
        is_python_module=False,  # the library registers its ops with torch on load
        no_implicit_headers=True,  # skip torch/extension.h (pybind): a faster build
        verbose=False,
    )


class LazyExtension:
    """An extension built on the first ``available()`` call, once per process."""

    def __init__(self, what: str, build: Callable[[], None]) -> None:
        self._what, self._build = what, build
        self._lock = threading.Lock()
        self._built: bool | None = None  # None until the first available() call

    def available(self) -> bool:
        """Build (once) and report whether the ops can run; never raises."""
        if self._built is None:
            with self._lock:
                if self._built is None:
                    try:
                        self._build()
                        self._built = True
                    # a missing compiler, headers or source file, whatever it raises
                    except Exception as exc:  # noqa: BLE001 (available() never raises)
                        logger.warning("%s unavailable, build failed: %s", self._what, exc)
                        self._built = False
        return self._built
