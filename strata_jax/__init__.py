"""strata_jax: decode large Mixture-of-Experts models on a GPU too small to hold every expert."""
from strata_jax.errors import StrataError

__all__ = ["Engine", "ExpertStats", "RequestStats", "StopRequest", "Stats", "StrataError"]

# The rest on first use (PEP 562): `python -m strata_jax.decode` and `strata-serve` set their Ctrl-C handling
# and answer --help before JAX is imported.
_LAZY = {"Engine": "strata_jax.engine", "StopRequest": "strata_jax.engine", "ExpertStats": "strata_jax.stats",
         "RequestStats": "strata_jax.stats", "Stats": "strata_jax.stats"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'strata_jax' has no attribute {name!r}")
