"""strata_jax: decode large Mixture-of-Experts models on a GPU too small to hold every expert."""
from strata_jax.engine import Engine, Stats, RequestStats
from strata_jax.errors import StrataError

__all__ = ["Engine", "Stats", "RequestStats", "StrataError"]
