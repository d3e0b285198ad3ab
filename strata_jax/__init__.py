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
_LAZY = {"Engine": "strata_jax.engine.api", "StopRequest": "strata_jax.engine.api",
         "ExpertStats": "strata_jax.engine.stats", "RequestStats": "strata_jax.engine.stats",
         "Stats": "strata_jax.engine.stats"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'strata_jax' has no attribute {name!r}")


# Modules that moved when the package took its rooms (2026-12-05). The old names still import, as the same module
# object, with one DeprecationWarning naming the new place; `strata_jax.model` (now a package: weights, kv_cache,
# transformer) and `strata_jax.engine` (now a package: Engine is in engine.api) are not aliased.
MOVED = {
    "strata_jax.config": "strata_jax.model.config", "strata_jax.linear": "strata_jax.model.linear",
    "strata_jax.moe": "strata_jax.model.moe", "strata_jax.deltanet": "strata_jax.model.deltanet",
    "strata_jax.quant": "strata_jax.model.quant", "strata_jax.experts": "strata_jax.offload",
    "strata_jax.experts.slots": "strata_jax.offload.slots",
    "strata_jax.experts.placement": "strata_jax.offload.placement",
    "strata_jax.experts.approx": "strata_jax.offload.approx", "strata_jax.experts.defer": "strata_jax.offload.defer",
    "strata_jax.drafts": "strata_jax.speculative.drafters",
    "strata_jax.device_drafts": "strata_jax.speculative.device_drafts",
    "strata_jax.mtp": "strata_jax.speculative.mtp", "strata_jax.graphs": "strata_jax.engine.graphs",
    "strata_jax.loops": "strata_jax.engine.loops", "strata_jax.stats": "strata_jax.engine.stats",
    "strata_jax.parallel": "strata_jax.engine.parallel", "strata_jax.checkpoint": "strata_jax.io.checkpoint",
    "strata_jax.embedded": "strata_jax.io.embedded", "strata_jax.tokenizer": "strata_jax.io.tokenizer",
    "strata_jax.chat": "strata_jax.io.chat", "strata_jax.logpos": "strata_jax.io.logpos",
}


class _MovedModules:
    """A meta path finder for MOVED: the old name gets the new module, and a DeprecationWarning."""

    def find_spec(self, name, path=None, target=None):
        if name not in MOVED:
            return None
        import importlib.util
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec):
        import importlib
        import warnings
        warnings.warn(f"{spec.name} is now {MOVED[spec.name]} (the package took its rooms on 2026-12-05); "
                      "import the new name", DeprecationWarning, stacklevel=2)
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module):
        pass  # the new module is imported already


_sys.meta_path.insert(0, _MovedModules())  # before the path finders: an old name never loads a second copy
