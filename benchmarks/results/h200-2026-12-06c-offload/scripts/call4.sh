# Call 4 (2026-12-06, third session): the pool's small jobs on the 16-core host (pool_small.sh: the kept team and
# job-sized blocks against the former OpenMP region per job); the fixed cost a MoE layer through the offload path at
# S=E (lru decode windows without the staging call), twice; the batched windows with the batched attention kernel;
# the top_p filter alone (radix select).
set -u; export PYTHONPATH=. PYTHONUNBUFFERED=1; T0=$SECONDS
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 170 bash benchmarks/results/h200-2026-12-06c-offload/scripts/pool_small.sh > $OUT/pool_small_run.log 2>&1
echo "pool_small rc=$? at $((SECONDS-T0)) s"; grep -E "^==|^bf16|^int4|timeline" $OUT/pool_small_run.log | cut -c1-180 | head -60
for v in a b; do
  timeout 75 python3 -m benchmarks.offload_bench --model=qwen3-30b-a3b --layers=12 --slot_fracs=1.0 --pcie_fracs=1 \
    --embed_scale=50 --new_tokens=64 > $OUT/fixed_$v.log 2>&1
  echo "fixed $v rc=$? at $((SECONDS-T0)) s: $(grep -E '^\| (all|S=)' $OUT/fixed_$v.log | cut -c1-160 | tr '\n' ' ')"
  grep -iE "fixed cost|over all resident" $OUT/fixed_$v.log | head -3 | cut -c1-200
done
timeout 110 python3 -m benchmarks.batch_bench --model=qwen3-30b-a3b --layers=12 --batch=1,2,4,8 --prompt=64 \
  --new_tokens=64 --attention_share --json=$OUT/batch.json > $OUT/batch.log 2>&1
echo "batch rc=$? at $((SECONDS-T0)) s"; grep -E "^\|" $OUT/batch.log
timeout 40 python3 - <<'PY' 2>&1 | tail -4
import time, jax, jax.numpy as jnp, numpy as np
from strata_jax import sampling
from strata_jax.sampling import SamplingParams
p = SamplingParams.make(0.7, 0.8, 0, 0)
for form in ("top_p", "top_k"):
  for t in (1, 4):
    f = jax.jit(lambda x, p: sampling.filter_rows(x, p, form))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((t, 151936)).astype(np.float32) * 3)
    f(x, p).block_until_ready(); t0 = time.perf_counter()
    for _ in range(200): y = f(x, p)
    y.block_until_ready(); print(f"{form} filter T={t}: {(time.perf_counter() - t0) / 200 * 1e6:.0f} us (radix {sampling.radix_bits()} bits)")
PY
echo "done at $((SECONDS-T0)) s"
cd $OUT && tar czf call4.tgz *.log *.json 2>/dev/null; rm -f *.json
