"""The house step's probe set: the same tokens and logits before and after a restructuring.

    python benchmarks/results/cpu-2026-12-05-house/probe.py ROOT OUT.npz    # ROOT: a checkout (old or new layout)
    python benchmarks/results/cpu-2026-12-05-house/probe.py --compare A.npz B.npz

Runs the reference model (float32, CPU) through `Engine.from_pretrained` of the checkout at ROOT, with only the
public API (`from strata_jax import Engine`), for every arm below: greedy and sampled tokens (generate), and the
teacher-forced logits (score) of a fixed text. --compare: tokens equal, logits within float32 1e-5 (relative)."""
from __future__ import annotations

import sys

import numpy as np

PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
TEXT = "import os\nimport sys\n\n\ndef main(argv):\n    for name in sorted(os.listdir(argv[1])):\n        print(name)\n"
ARMS = {  # name -> engine options
    "resident": dict(expert_cache_slots="all"),
    "lru16_pcie": dict(expert_cache_slots="16", pcie_frac=1),
    "lru16_split": dict(expert_cache_slots="16", pcie_frac=0.5),
    "static16_pool": dict(expert_cache_slots="16", pcie_frac=0, cache_policy="static"),
    "unrolled16": dict(expert_cache_slots="16", pcie_frac=1, layer_loop="unrolled"),
    "tail_skip": dict(expert_cache_slots="16", pcie_frac=1, route_tail_skip="6"),
    "route_prior": dict(expert_cache_slots="16", pcie_frac=1, route_prior="0.5"),
}
REQUESTS = {  # name -> generate() options
    "greedy": dict(max_new_tokens=24, temperature=0),
    "greedy_spec0": dict(max_new_tokens=24, temperature=0, spec=0),
    "sampled": dict(max_new_tokens=24, temperature=0.7, top_k=20, top_p=0.8, seed=3),
    "device_drafts": dict(max_new_tokens=24, temperature=0, draft="device"),
}


def run(root: str, out: str) -> None:
    sys.path.insert(0, root)
    from strata_jax import Engine
    results = {}
    for arm, opts in ARMS.items():
        eng = Engine.from_pretrained("reference", verbose=False, dtype="float32", window=4, context=512, **opts)
        ids = eng.encode(PROMPT)
        for req, ropts in REQUESTS.items():
            if req == "device_drafts" and arm != "resident":
                continue  # draft=device with offload: the same windows as greedy
            results[f"{arm}/{req}"] = np.asarray(eng.generate(ids, **ropts), np.int32)
            print(arm, req, results[f"{arm}/{req}"].tolist()[:8], file=sys.stderr, flush=True)
        results[f"{arm}/score"] = np.asarray(eng.score(eng.encode(TEXT)), np.float32)
        del eng
    np.savez(out, **results)


def compare(a: str, b: str) -> int:
    x, y = np.load(a), np.load(b)
    assert sorted(x.files) == sorted(y.files), (sorted(x.files), sorted(y.files))
    bad = 0
    for k in sorted(x.files):
        if k.endswith("/score"):
            rel = float(np.linalg.norm(x[k] - y[k]) / np.linalg.norm(x[k]))
            ok = rel <= 1e-5
            print(f"{k:28s} logits {x[k].shape}  relative difference {rel:.2e}  {'ok' if ok else 'DIFFERENT'}")
        else:
            ok = x[k].shape == y[k].shape and bool((x[k] == y[k]).all())
            print(f"{k:28s} tokens {len(x[k]):3d}  {'equal' if ok else 'DIFFERENT'}")
        bad += not ok
    print(f"{len(x.files) - bad} of {len(x.files)} probes equal")
    return 1 if bad else 0


if __name__ == "__main__":
    if sys.argv[1] == "--compare":
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    run(sys.argv[1], sys.argv[2])
