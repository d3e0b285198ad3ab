"""Issue 34's fixed cost a MoE layer without the cold fetches: all resident against S=E through the offload path
(PCIe only, lru), both engines in one process, each given warm-up requests until a whole request fetches nothing,
then timed requests taken in turn (resident, S=E, resident, ...), 128 tokens each, spec=0, temperature 1, spread
routing. offload_bench's S=E arm fetches ~1 expert a token in its timed request (experts the warm-up never routed
to), so its difference to all resident holds those bytes too. Run: python3 fixed_cost.py [layers] [reps]."""
import statistics, sys, time

import numpy as np

from strata_jax import Engine
from strata_jax.model.config import preset

layers = int(sys.argv[1]) if len(sys.argv) > 1 else 12
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 5
cfg = preset("qwen3-30b-a3b", layers=layers)
rng = np.random.default_rng(1)
req = dict(max_new_tokens=128, temperature=1.0, seed=0, stop_token_ids=[], spec=0, draft="none")
arms = {}
for name, opts in (("resident", dict(expert_cache_slots="all")),
                   ("S=E", dict(expert_cache_slots=cfg.num_experts, pcie_frac=1.0))):
    t0 = time.time()
    eng = Engine.from_random(cfg, seed=0, verbose=False, embed_scale=50, **opts)
    for i in range(12):  # until a request fetches nothing (S=E), at least 2
        eng.generate(rng.integers(0, cfg.vocab_size, 16).tolist(), **req)
        fetched = eng.stats.last.decode_experts.distinct_fetched if name == "S=E" else 0
        if i >= 1 and fetched == 0:
            break
    print(f"{name}: built and warmed in {time.time() - t0:.1f} s ({i + 1} warm-up requests, last fetched {fetched})",
          flush=True)
    arms[name] = dict(engine=eng, ms=[], fetched=[])
for r in range(reps):
    prompt = rng.integers(0, cfg.vocab_size, 16).tolist()
    for name, arm in arms.items():
        arm["engine"].generate(prompt, **req)
        last = arm["engine"].stats.last
        arm["ms"].append(last.decode_s / max(last.windows, 1) * 1e3)
        arm["fetched"].append(last.decode_experts.distinct_fetched if name == "S=E" else 0)
res, sie = (statistics.median(arms[n]["ms"]) for n in ("resident", "S=E"))
print(f"{layers} layers, {reps} requests each, median ms/token: resident {res:.4f}, S=E {sie:.4f} "
      f"(fetched in timed requests: {arms['S=E']['fetched']}); fixed cost a MoE layer {(sie - res) / layers:.4f} ms")
for name, arm in arms.items():
    print(f"  {name}: " + " ".join(f"{m:.4f}" for m in arm["ms"]))
