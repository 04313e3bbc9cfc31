"""How the CPU C++ kernels (``cpu_decode``, ``cpu_fused``) are built and loaded.

Each is a torch op library compiled on first use with ``load_inline`` and
``-march=native`` (the machine that builds it runs it) into the torch extensions cache
(``TORCH_EXTENSIONS_DIR``). The extension name carries a hash of its sources, flags,
torch version and CPU flags, so any change rebuilds. ``LazyExtension`` builds once per
process and reports whether that worked, so callers can keep their torch path.
"""

from __future__ import annotations

import hashlib
import logging
import platform
import re
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SCALAR_HEADER = CSRC / "cpu_scalar.h"  # the conversions and exp every kernel includes
# no -ffast-math: IEEE semantics (NaN, summation order as written) in every loop
_CFLAGS = ["-O3", "-march=native", "-std=c++17"]


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
    from torch.utils.cpp_extension import load_inline

    source = source_file.read_text()
    headers = [h.read_text() for h in header_files]
    omp_cflags, ldflags = _openmp_flags()
    cflags = [*_CFLAGS, *extra_cflags, *omp_cflags, f"-DPAGODA_OP_NS={namespace}",
              *(f"-D{d}" for d in defines)]
    key = "\n".join([source, *headers, *cflags, *ldflags, _host_tag()])
    start = time.perf_counter()
    load_inline(
        name=f"{namespace}_{hashlib.sha256(key.encode()).hexdigest()[:10]}",
        cpp_sources=[source],
        extra_cflags=cflags,
        extra_ldflags=ldflags,
        extra_include_paths=[str(CSRC)],
        is_python_module=False,  # the library registers its ops with torch on load
        no_implicit_headers=True,  # skip torch/extension.h (pybind): a faster build
        verbose=False,
    )
    logger.info("%s extension ready in %.1f s", namespace, time.perf_counter() - start)


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
