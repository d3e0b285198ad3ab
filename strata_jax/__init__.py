"""strata_jax: decode large Mixture-of-Experts models on a GPU too small to hold every expert."""
import sys as _sys

if _sys.argv[:1] == ["-m"] and {"strata_jax.decode", "strata_jax.serve"} & set(getattr(_sys, "orig_argv", ())):
    # `python -m strata_jax.decode` / `.serve` imports this package first: Ctrl-C exits 130 from here on, until
    # the program sets its own handling (a KeyboardInterrupt in the middle of an import is a traceback).
    import os as _os
    import signal as _signal
    if _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler:
        _signal.signal(_signal.SIGINT, lambda signum, frame: _os._exit(130))

# Installed, host_pool/ and pallas_kernels/ are strata_jax.host_pool and strata_jax.pallas_kernels (pyproject's
# package-dir). Run from the repository (`make test`, `make run`: sys.path is its root), they are this folder's
# siblings: the root joins the package's path, so the same names find them there (one copy of each module; the
# code never imports a top-level `host_pool`).
import os.path as _osp  # noqa: E402

_root = _osp.dirname(_osp.dirname(_osp.abspath(__file__)))
if not _osp.isdir(_osp.join(__path__[0], "host_pool")) and _osp.isfile(_osp.join(_root, "host_pool", "__init__.py")):
    __path__.append(_root)

from strata_jax.errors import StrataError  # noqa: E402

__all__ = ["Engine", "ExpertStats", "RequestStats", "StopRequest", "Stats", "StrataError"]

# The rest on first use (PEP 562): `python -m strata_jax.decode` and `strata-serve` set their Ctrl-C handling
# and answer --help before JAX is imported.
_LAZY = {"Engine": "strata_jax.engine.api", "StopRequest": "strata_jax.engine.api", "ExpertStats": "strata_jax.engine.stats",
         "RequestStats": "strata_jax.engine.stats", "Stats": "strata_jax.engine.stats"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'strata_jax' has no attribute {name!r}")
