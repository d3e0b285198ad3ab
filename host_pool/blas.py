"""Set the thread count of the OpenBLAS that numpy uses (threadpoolctl-free).

Pool threads each run small matmuls; if OpenBLAS also spreads every call over
all cores, the cores are oversubscribed (measured: see host_pool.measure).
"""

from __future__ import annotations

import ctypes

# Names OpenBLAS builds export (numpy wheels use the scipy_ prefixed ILP64 build).
_SET_NAMES = ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
              "openblas_set_num_threads64_", "openblas_set_num_threads")
_GET_NAMES = tuple(name.replace("set_", "get_") for name in _SET_NAMES)


def _loaded_openblas() -> list[str]:
    """Paths of OpenBLAS libraries mapped into this process (numpy imported first)."""
    import numpy  # noqa: F401  (loads numpy's BLAS)
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "openblas" in line.lower()}
    except OSError:
        return []
    return sorted(path for path in paths if path.startswith("/"))


def _find(names: tuple[str, ...]):
    for path in _loaded_openblas():
        lib = ctypes.CDLL(path)
        for name in names:
            function = getattr(lib, name, None)
            if function is not None:
                return function
    return None


def set_blas_threads(threads: int) -> bool:
    """Process-wide OpenBLAS thread count; False if numpy's BLAS was not found."""
    function = _find(_SET_NAMES)
    if function is None:
        return False
    function(ctypes.c_int(threads))
    return True


def get_blas_threads() -> int | None:
    function = _find(_GET_NAMES)
    return None if function is None else int(function())
