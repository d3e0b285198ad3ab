"""The thread count of numpy's BLAS, through threadpoolctl (OpenBLAS, MKL, BLIS alike).

Pool threads each run small matmuls; if the BLAS also spreads every call over all cores, the cores are
oversubscribed (measured on a 2-core machine: 1.5 to 6x slower; see strata_jax.host_pool.measure).
"""

from __future__ import annotations

import numpy  # noqa: F401  (loads numpy's BLAS before threadpoolctl looks for it)
from threadpoolctl import threadpool_info, threadpool_limits

_limits = None  # kept alive: the limit holds until it is restored


def set_blas_threads(threads: int) -> bool:
    """Process-wide BLAS thread count; False if no BLAS library was found."""
    global _limits
    if not blas_libraries():
        return False
    _limits = threadpool_limits(limits=threads, user_api="blas")
    return True


def get_blas_threads() -> int | None:
    libs = blas_libraries()
    return min(lib["num_threads"] for lib in libs) if libs else None


def blas_libraries() -> list[dict]:
    return [lib for lib in threadpool_info() if lib.get("user_api") == "blas"]


def describe() -> str:
    libs = blas_libraries()
    if not libs:
        return "no BLAS library found"
    return ", ".join(f"{lib['internal_api']} {lib['num_threads']} thread(s) per call" for lib in libs)
