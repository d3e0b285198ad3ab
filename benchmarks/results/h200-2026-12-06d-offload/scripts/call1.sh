# Call 1 (2026-12-06, fourth session; one call: device machines were scarce). llama.cpp builds (setsid) and the
# 12-layer F16 GGUF is written after it, while the GPU tests of the signal kernels run (a begin posts its plan and
# a collect waits for y with one kernel each, instead of a copy + a flag write and a flag wait + a flag write + a
# copy; STRATA_OFFLOAD_SIGNAL=memops keeps the former way: the arms below fall back to it if the tests fail). Then
# llama.cpp and our generate loop on 12 layers of the 30B shape in one process (peer_bench, routing spread):
# pcie_frac=auto, the host pool alone and PCIe only at 64 / 32 of 128 slots (-ncmoe 6 / 9), no drafts, temperature
# 1, most wanted first (a cut run keeps the arms done: progress lines). Last, if time is left: the sampler's top_k
# form, its radix select against lax.top_k's candidates.
set -u; export PYTHONPATH=. PYTHONUNBUFFERED=1 TESTS_COMPILE_GRAPHS=lazy; LLAMA=/tmp/llama.cpp; T0=$SECONDS
nvidia-smi --query-gpu=name --format=csv,noheader; lscpu | grep -E "Model name|^CPU\(s\)|Thread\(s\) per core|Core\(s\) per socket"
git log --oneline -1 | cut -c1-80
setsid nohup bash benchmarks/peer/build_llama.sh "$PWD/.peer/llama.tar.xz" $LLAMA > /dev/null 2>&1 < /dev/null &
setsid nohup bash -c "while [ ! -d $LLAMA/gguf-py ]; do sleep 2; done; python3 benchmarks/peer/write_gguf.py \
  --out=/tmp/gguf.part --model=qwen3-30b-a3b --layers=12 --gguf_py=$LLAMA/gguf-py > /tmp/gguf.log 2>&1 \
  && mv /tmp/gguf.part /tmp/qwen3-30b-a3b-12.gguf; echo rc=\$? > /tmp/gguf.done" > /dev/null 2>&1 < /dev/null &
timeout 230 python3 -m pytest -q -p no:cacheprovider -o console_output_style=classic tests/engine/test_gpu.py \
  tests/offload/test_defer.py -k "offload_is_exact or former_ways or blocks_of_experts or (defer_matches and auto)" \
  > $OUT/tests.log 2>&1
rc=$?; echo "tests rc=$rc at $((SECONDS-T0)) s: $(tail -1 $OUT/tests.log | cut -c1-160)"
grep -E "^(FAILED|ERROR)|Error" $OUT/tests.log | head -5 | cut -c1-200
[ $rc -ne 0 ] && export STRATA_OFFLOAD_SIGNAL=memops && echo "tests failed: the arms run STRATA_OFFLOAD_SIGNAL=memops"
while { [ ! -f $LLAMA.done ] || [ ! -f /tmp/gguf.done ]; } && [ $((SECONDS - T0)) -lt 330 ]; do sleep 3; done
echo "build: $(cat $LLAMA.done 2>/dev/null || echo not done); gguf: $(cat /tmp/gguf.done 2>/dev/null) at $((SECONDS - T0)) s"
T1="spec=0,temperature=1"
timeout $((575 - (SECONDS - T0))) python3 -m benchmarks.peer_bench --layers=12 --llama_bench=$LLAMA/build/bin/llama-bench \
  --gguf_py=$LLAMA/gguf-py --ncmoe=6,9 --embed_scale=50 --reps=2 \
  --ours="expert_cache_slots=64,$T1;expert_cache_slots=32,$T1;expert_cache_slots=64,pcie_frac=0,$T1;expert_cache_slots=32,pcie_frac=1,$T1;expert_cache_slots=64,pcie_frac=1,$T1;expert_cache_slots=32,pcie_frac=0,$T1" \
  --json=$OUT/peer12.json > $OUT/peer12.log 2>&1
echo "peer12 rc=$? at $((SECONDS - T0)) s"; grep -E "^\||error|Error|pcie_frac: | ours \[| peer: " $OUT/peer12.log | cut -c1-240 | tail -32
# the sampler's top_k form: the radix select (this GPU's way) against lax.top_k's 64 candidates, and top_p's
[ $((SECONDS-T0)) -lt 560 ] && timeout 30 python3 - <<'PY' 2>&1 | tail -6
import time, jax, jax.numpy as jnp, numpy as np
from strata_jax import sampling
from strata_jax.sampling import SamplingParams
for name, p in (("top_k 20 / top_p 0.8", SamplingParams.make(0.7, 0.8, 20, 0)), ("top_p 0.8", SamplingParams.make(0.7, 0.8, 0, 0))):
  form = sampling.form_of(int(p.top_k), float(p.top_p))
  for select in (("radix", "lax") if form == "top_k" else ("-",)):
    sampling.TOP_K_SELECT = None if select == "-" else select
    for t in (1, 4):
      f = jax.jit(lambda x, p: sampling.filter_rows(x, p, form))
      x = jnp.asarray(np.random.default_rng(0).standard_normal((t, 151936)).astype(np.float32) * 3)
      f(x, p).block_until_ready(); t0 = time.perf_counter()
      for _ in range(200): y = f(x, p)
      y.block_until_ready(); print(f"{name} ({form}, {select}) T={t}: {(time.perf_counter() - t0) / 200 * 1e6:.0f} us")
PY
cd $OUT && tar czf call1.tgz *.log *.json 2>/dev/null && rm -f *.json; echo "done at $((SECONDS-T0)) s"
