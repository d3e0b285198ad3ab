"""The engine: one request's resources decided once (plan.py), the compiled graphs (graphs.py), the request loops
over those graphs (loops.py), the counters (stats.py), and the public face, `Engine` (api.py).

`from strata_jax import Engine` is the public name; this package's modules import the rest of strata_jax, nothing
below imports them.
"""


def __getattr__(name: str):
    # `from strata_jax.engine import Engine` (the name before the rooms) keeps working, on first use
    if name in ("Engine", "StopRequest"):
        from strata_jax.engine import api
        return getattr(api, name)
    raise AttributeError(f"module 'strata_jax.engine' has no attribute {name!r}")
