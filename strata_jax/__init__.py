"""strata_jax: decode large Mixture-of-Experts models on a GPU too small to hold every expert."""
from strata_jax.engine import Engine, StopRequest
from strata_jax.stats import ExpertStats, RequestStats, Stats
from strata_jax.errors import StrataError

__all__ = ["Engine", "ExpertStats", "RequestStats", "StopRequest", "Stats", "StrataError"]
