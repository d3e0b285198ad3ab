"""strata_jax: decode large Mixture-of-Experts models on a GPU too small to hold every expert."""
from strata_jax.engine import Engine
from strata_jax.stats import ExpertStats, RequestStats, Stats
from strata_jax.errors import StrataError

__all__ = ["Engine", "ExpertStats", "RequestStats", "Stats", "StrataError"]
