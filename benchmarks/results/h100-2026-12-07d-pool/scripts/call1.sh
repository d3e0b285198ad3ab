# Call 1 (issue 33, then 39): where a pool-alone layer's time goes, and whether the deferral pays with the native
# pool. offload_bench at 12 layers, 64 of 128 slots, pcie_frac 0 (every miss on the pool), spread routing: the
# offload worker's host clock (POSTED seen -> DONE, the job inside it, DONE -> the next POSTED seen) beside the
# all-resident layer; the deferral (STRATA_VERIFY_DEFER_CPU=1, its 0.1 split) mirrored against the plain engine in
# the same process; then the kept team's idle spin 1000 us (the gap between two layers' jobs is ~0.17 ms, the team
# sleeps after 200) with 16 and 14 threads. Then the tenth session's call 6, trimmed: stacked_linear's folds.
set -u; export PYTHONPATH=. PYTHONUNBUFFERED=1; T0=$SECONDS; D=$OUT/c1; mkdir -p $D
pack() { tar czf $OUT/c1.tgz -C $OUT c1; }
nvidia-smi --query-gpu=name --format=csv,noheader; lscpu | grep -E "Model name|^CPU\(s\)|Thread\(s\)"; git log --oneline -1 | cut -c1-80
B="python3 -m benchmarks.offload_bench --model=qwen3-30b-a3b --layers=12 --embed_scale=50 --new_tokens=64 --slot_fracs=0.5 --pcie_fracs=0"
show() { grep -E "offload worker|tok/s \(|x.* vs plain" $1 | cut -c1-220; }
timeout 150 $B --switch_arms="defer:STRATA_VERIFY_DEFER_CPU=1" --json=$D/pool-defer.json > $D/pool-defer.log 2>&1
echo "pool+defer rc=$? at $((SECONDS - T0)) s"; show $D/pool-defer.log; pack
STRATA_POOL_SPIN_US=1000 timeout 70 $B --json=$D/pool-spin1000.json > $D/pool-spin1000.log 2>&1
echo "spin 1000 rc=$? at $((SECONDS - T0)) s"; show $D/pool-spin1000.log; pack
STRATA_POOL_SPIN_US=1000 timeout 70 $B --cpu_threads=14 --json=$D/pool-t14-spin1000.json > $D/pool-t14-spin1000.log 2>&1
echo "14 threads spin 1000 rc=$? at $((SECONDS - T0)) s"; show $D/pool-t14-spin1000.log; pack
TD=$PWD/benchmarks/results/h100-2026-12-07c-route/tuning
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gpu_kernels.py tests/kernels/test_stacked_linear.py \
  -k "fold" > $D/gpu-tests.log 2>&1
echo "gpu tests rc=$? at $((SECONDS - T0)) s"; tail -2 $D/gpu-tests.log | cut -c1-200; pack
for arm in default fold fold default; do
  env=""; [ $arm != default ] && env="STRATA_KERNEL_TUNING=$TD/$arm.json"
  env $env timeout 45 python3 -m benchmarks.decode_bench --model=qwen3-30b-a3b --layers=24 --windows=1 --hf=off \
    --iters=30 --json=$D/window-$arm-$SECONDS.json > $D/window-$arm-$SECONDS.log 2>&1
  echo "window $arm rc=$? at $((SECONDS - T0)) s: $(python3 -c "import json,glob; f=sorted(glob.glob('$D/window-$arm-*.json'))[-1]; r=json.load(open(f))['rows'][0]; print(f\"synced {r['ms_per_step']:.3f} ms, pipelined {r['ms_per_step_pipelined']:.3f} ms\")" 2>&1 | tail -1)"; pack
done
Q="temperature=0.7,top_k=20,top_p=0.8"
for arm in default fold; do
  env=""; [ $arm != default ] && env="STRATA_KERNEL_TUNING=$TD/$arm.json"
  env $env timeout 80 python3 -m benchmarks.peer_bench --layers=24 --llama_bench= --reps=3 --ours="spec=0;$Q" \
    --json=$D/p24-$arm.json > $D/p24-$arm.log 2>&1
  echo "loop $arm rc=$? at $((SECONDS - T0)) s"; grep -E "^\| strata|rror" $D/p24-$arm.log | cut -c1-160; pack
done
echo "done at $((SECONDS - T0)) s"
