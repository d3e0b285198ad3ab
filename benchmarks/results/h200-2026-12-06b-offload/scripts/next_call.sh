# For the next GPU session (written 2026-12-06, not run): one call (~9 min), no peer build. What this session built
# and could not time.
# 1. int4-q4k (GGUF Q4_K's blocks kept packed) on a GPU: its kernel, GGUF and pool tests (interpreted only so far).
# 2. The pool's job timeline (measure.py --timeline) for jobs of 1, 2 and 8 experts on the 16-core host: where a
#    layer's small CPU share spends its 0.14-0.26 ms beyond its bytes (issue 33).
# 3. int4-q4k against int4 experts at 25% of the slots, PCIe only and auto, one process each (issue 36's figures).
# 4. The batched windows again (batch_bench), for a baseline before the attention stops looping over rows.
set -u; export PYTHONPATH=. PYTHONUNBUFFERED=1 TESTS_COMPILE_GRAPHS=lazy; T0=$SECONDS
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_expert_ffn.py -k q4k tests/io/test_gguf_q4k.py \
  tests/host_pool/test_host_pool_q4k.py > $OUT/q4k_tests.log 2>&1
echo "q4k tests rc=$? at $((SECONDS-T0)) s"; tail -2 $OUT/q4k_tests.log | cut -c1-200
for e in 1 2 8; do timeout 40 python3 -m strata_jax.host_pool.measure --threads 16 --experts $e --formats bf16 \
  --windows 1 --paths C --read_mb 1024 --hot-intermediate 0 --timeline > $OUT/timeline_e$e.log 2>&1
  echo "experts $e:"; grep -E "^bf16|timeline|read bandwidth" $OUT/timeline_e$e.log; done
for ed in int4 int4-q4k; do timeout 90 python3 -m benchmarks.offload_bench --model=qwen3-30b-a3b --layers=12 \
  --dtype=bfloat16 --expert_dtype=$ed --slot_fracs=0.25 --pcie_fracs=1,auto --embed_scale=50 --new_tokens=64 \
  --json=$OUT/offload_$ed.json > $OUT/offload_$ed.log 2>&1
  echo "$ed rc=$? at $((SECONDS-T0)) s"; grep -E "^\| (all|S=)|pcie_frac: " $OUT/offload_$ed.log | cut -c1-200; done
timeout 100 python3 -m benchmarks.batch_bench --model=qwen3-30b-a3b --layers=12 --batch=1,2,4,8 --prompt=64 \
  --new_tokens=64 --json=$OUT/batch.json > $OUT/batch.log 2>&1
echo "batch rc=$? at $((SECONDS-T0)) s"; grep -E "^\|" $OUT/batch.log
cd $OUT && tar czf next_call.tgz *.log *.json 2>/dev/null && rm -f *.json
