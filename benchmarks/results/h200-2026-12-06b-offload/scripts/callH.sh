# Call H: (1) batched decode windows (87f12a3, issue 38) on a GPU: batch_bench 12 layers, B = 1, 2, 4, 8, all resident;
# (2) the pool's small jobs (1 and 2 experts, as a layer's CPU share at 25-50% of the slots) with smaller phase-1
# blocks; (3) the pool alone at 50% (pcie_frac 0) with 16 / 14 threads (16 threads share 16 cores with the
# offload worker, Python's dispatch and XLA's threads).
set -u; export PYTHONPATH=. PYTHONUNBUFFERED=1; T0=$SECONDS
timeout 100 python3 -m benchmarks.batch_bench --model=qwen3-30b-a3b --layers=12 --batch=1,2,4,8 --prompt=64 \
  --new_tokens=64 --json=$OUT/batch.json > $OUT/batch.log 2>&1
echo "batch rc=$? at $((SECONDS-T0)) s"; grep -E "^\||rror" $OUT/batch.log | cut -c1-200
for e in 1 2; do timeout 40 python3 -m strata_jax.host_pool.measure --threads 16 --experts $e --formats bf16 --windows 1 \
  --paths C --read_mb 1024 --variants "default ROWS_UP=16 ROWS_UP=8" > $OUT/pool_e$e.log 2>&1
  echo "pool experts $e rc=$?"; grep -E "^bf16|read bandwidth" $OUT/pool_e$e.log | head -4; done
for t in 16 14; do [ $((SECONDS-T0)) -gt 190 ] && { echo "skip threads $t"; continue; }
  timeout 45 python3 -m benchmarks.offload_bench --model=qwen3-30b-a3b --layers=12 --slot_fracs=0.5 --pcie_fracs=0 \
  --cpu_threads=$t --embed_scale=50 --new_tokens=64 > $OUT/threads$t.log 2>&1
  echo "threads $t rc=$?: $(grep -E '^\| (all|S=)' $OUT/threads$t.log | awk -F'|' '{print $2 $5 $14}' | tr '\n' ' ')"; done
