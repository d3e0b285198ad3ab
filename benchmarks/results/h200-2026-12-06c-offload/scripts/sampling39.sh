# Issue 39 on branch sampling39: the arms of call 1's 12-layer sampling table again (no peer), to measure
# (a) the "top_p" form's radix select (was a 32-step bisection: 558.7 tok/s against the top_k form's 658.0) and
# (b) a sampled request's watching DraftGate (default settings were 570.9 against spec=0's 663.9: 13 drafts, none
# accepted). --reps=5 so a first run of a window size inside the timed requests shows in the samples (JSON).
set -u; export PYTHONPATH=. PYTHONUNBUFFERED=1; T0=$SECONDS
nvidia-smi --query-gpu=name --format=csv,noheader; git log --oneline -1
Q="temperature=0.7,top_k=20,top_p=0.8"
timeout 200 python3 -m benchmarks.peer_bench --layers=12 --llama_bench= --reps=5 --embed_scale=50 \
  --ours="default;spec=0;$Q;$Q,spec=0;temperature=1;temperature=1,spec=0;temperature=0.7,top_p=0.8,spec=0;temperature=0.7,top_p=0.8;temperature=0.7,top_k=20,spec=0" \
  --json=$OUT/sampling39.json > $OUT/sampling39.log 2>&1
echo "sampling rc=$? at $((SECONDS-T0)) s"; grep -E "^\||rror" $OUT/sampling39.log | cut -c1-220
python3 - "$OUT/sampling39.json" <<'PY' 2>&1
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["ours"]:  # per-request samples: a slow first rep of a new window size stands out here
    print(f"{r['arm']:48s} {r['tok_s']:7.1f}  samples {[round(x) for x in r['samples']]}  windows {r['windows']}  "
          f"drafts {r['drafts_accepted']}/{r['drafts_proposed']}  host gap {r['host_gap_ms']:.2f} ms")
PY
# the filter alone on the GPU: bisection (main) against radix, T=1 and T=4 at V=151936
timeout 30 python3 - <<'PY' 2>&1 | tail -4
import time, jax, jax.numpy as jnp, numpy as np
from strata_jax import sampling
from strata_jax.sampling import SamplingParams
p = SamplingParams.make(0.7, 0.8, 0, 0)
for t in (1, 4):
    f = jax.jit(lambda x, p: sampling.filter_rows(x, p, "top_p"))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((t, 151936)).astype(np.float32) * 3)
    f(x, p).block_until_ready(); t0 = time.perf_counter()
    for _ in range(200): y = f(x, p)
    y.block_until_ready(); print(f"top_p filter T={t}: {(time.perf_counter() - t0) / 200 * 1e6:.0f} us (radix {sampling.radix_bits()} bits)")
PY
echo "done at $((SECONDS-T0)) s"
