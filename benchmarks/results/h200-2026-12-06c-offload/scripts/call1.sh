# Call 1 (2026-12-06, third session): int4-q4k's GPU tests; the pool's job timeline for 1 / 2 / 8 experts and the
# formats' time per expert (issue 33); issue 39's sampled gap isolated at 12 layers, one process, no peer.
set -u; export PYTHONPATH=. PYTHONUNBUFFERED=1 TESTS_COMPILE_GRAPHS=lazy; T0=$SECONDS
nvidia-smi --query-gpu=name --format=csv,noheader; lscpu | grep -E "Model name|^CPU\(s\)"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_expert_ffn.py -k q4k tests/io/test_gguf_q4k.py \
  tests/host_pool/test_host_pool_q4k.py > $OUT/q4k_tests.log 2>&1
echo "q4k tests rc=$? at $((SECONDS-T0)) s"; tail -2 $OUT/q4k_tests.log | cut -c1-200
for e in 1 2 8; do timeout 40 python3 -m strata_jax.host_pool.measure --threads 16 --experts $e --formats bf16 \
  --windows 1 --paths C --read_mb 1024 --hot-intermediate 0 --timeline > $OUT/timeline_e$e.log 2>&1
  echo "experts $e:"; grep -E "^bf16|timeline|read bandwidth|setup|wake|phase" $OUT/timeline_e$e.log | head -12; done
timeout 60 python3 -m strata_jax.host_pool.measure --threads 16 --experts 8 --formats bf16,int8,int4 \
  --windows 1 --paths C --read_mb 1024 > $OUT/formats.log 2>&1; echo "formats rc=$?"; tail -12 $OUT/formats.log
Q="temperature=0.7,top_k=20,top_p=0.8"
timeout 280 python3 -m benchmarks.peer_bench --layers=12 --llama_bench= --reps=3 --embed_scale=50 \
  --ours="default;spec=0;$Q;$Q,spec=0;temperature=1;temperature=1,spec=0;temperature=0.7,top_p=0.8,spec=0;temperature=0.7,top_k=20,spec=0" \
  --json=$OUT/sampling12.json > $OUT/sampling12.log 2>&1
echo "sampling rc=$? at $((SECONDS-T0)) s"; grep -E "^\||rror" $OUT/sampling12.log | cut -c1-220
cd $OUT && tar czf call1.tgz *.log *.json 2>/dev/null && rm -f *.json
