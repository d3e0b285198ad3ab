"""Run a benchmark program with the kernel tuning the sweep found (kernel_sweep.py's JSON): the expert FFN's best
configuration for T <= 4 (its T=1 row) and for larger windows (its T=8 row), the stacked attention products' for
q/k/v (x 2048 wide) and o (x 4096 wide), each by T likewise (prefill chunks, T > 16, keep the defaults), put in place of the kernels' defaults in every module
that calls them. A measurement aid for one call: the chosen defaults go into the kernels' code afterwards.

    PYTHONPATH=. python3 tuned_run.py SWEEP.json benchmarks.peer_bench --layers=24 ...
"""
import functools
import importlib
import json
import sys

from strata_jax.pallas_kernels import expert_ffn as ffn
from strata_jax.pallas_kernels import stacked_linear as sl

sweep = json.load(open(sys.argv[1]))
ffn_best = {int(t): r["best"] for t, r in sweep["ffn"].items()}
lin_best = {(k.split(":")[0], int(k.split(":")[1])): r["best"] for k, r in sweep["linear"].items()}
orig_ffn, orig_lin = ffn.expert_ffn, sl.stacked_linear


@functools.wraps(orig_ffn)
def tuned_ffn(x, *a, **kw):  # prefill chunks (T > 16) as the kernel's defaults
    cfg = {} if x.shape[0] > 16 else ffn_best.get(1 if x.shape[0] <= 4 else 8, {})  # a case the sweep left: defaults
    return orig_ffn(x, *a, **{**cfg, **kw})


@functools.wraps(orig_lin)
def tuned_lin(x, weights, layer, **kw):
    which = "qkv" if len(tuple(weights)) > 1 else "o"
    cfg = {} if x.shape[0] > 16 else lin_best.get((which, 1 if x.shape[0] <= 4 else 8), {})
    return orig_lin(x, weights, layer, **{**cfg, **kw})


for mod, name, f in (("strata_jax.model.moe", "expert_ffn_kernel", tuned_ffn),
                     ("strata_jax.offload.slots", "expert_ffn_kernel", tuned_ffn),
                     ("strata_jax.engine.parallel", "expert_ffn_kernel", tuned_ffn),
                     ("strata_jax.model.transformer", "stacked_linear", tuned_lin)):
    setattr(importlib.import_module(mod), name, f)
print(f"tuned kernels: expert_ffn {ffn_best}; stacked_linear {lin_best}", flush=True)
program = importlib.import_module(sys.argv[2])
program.main([sys.argv[2]] + sys.argv[3:])
