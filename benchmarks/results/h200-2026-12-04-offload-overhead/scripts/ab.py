"""A/B of the offload calls' two CUDA paths in one process: capture (v2) and sequence (STRATA_OFFLOAD_CAPTURE=0),
12 layers of the 30B shape, S = slots, generate() alternated A B B A ... (decode tok/s, median)."""
import os, sys, statistics, time
sys.path.insert(0, ".")
import numpy as np
from strata_jax.config import preset
from strata_jax.engine import Engine
slots, layers, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
model = sys.argv[4] if len(sys.argv) > 4 else "qwen3-30b-a3b"
cfg = preset(model, layers=layers)
engines = {}
for name, env in (("capture", "1"), ("sequence", "0")):
    os.environ["STRATA_OFFLOAD_CAPTURE"] = env
    e = Engine.from_random(cfg, seed=0, verbose=False, embed_scale=50.0, expert_cache_slots=slots, pcie_frac="1",
                           window=1, context=512, compile_graphs="ahead")
    engines[name] = (e, env)
rng = np.random.default_rng(0)
runs = {k: [] for k in engines}
order = ["capture", "sequence", "sequence", "capture"] * reps
for i, name in enumerate(order):
    e, env = engines[name]
    os.environ["STRATA_OFFLOAD_CAPTURE"] = env
    prompt = rng.integers(0, cfg.vocab_size, 32).tolist()
    e.generate(prompt, 64, temperature=1.0, seed=i, stop_token_ids=[], draft="none")
    r = e.stats.last
    runs[name].append(r.decode_tok_s)
    print(f"{name:9s} {r.decode_tok_s:7.1f} tok/s  {1e3 * r.decode_s / max(r.windows, 1):.3f} ms/token  "
          f"fetched/token {r.decode_experts.distinct_fetched / max(r.windows, 1):.2f}", flush=True)
for k, v in runs.items():
    print(f"{k}: median {statistics.median(v):.1f} tok/s ({1e3 / statistics.median(v):.3f} ms/token) over {len(v)}")
