# Call 6 (not run: written for the next GPU session): stacked_linear's folds (the one-token row put in the kernel's
# tile: no pad op before the q/k/v and o products; the input RMSNorm in the q/k/v product: no norm op), alone
# (../tuning/fold.json) and with qkv_rope (fold-rope.json), against the default: their GPU tests; the 24-layer T=1
# window, mirrored; the fold's profile; the generate loop at 24 layers (greedy spec=0, Qwen3's sampling with
# default settings). ~4 minutes on an H100.
set -u; export PYTHONPATH=. PYTHONUNBUFFERED=1; T0=$SECONDS; D=$OUT/c6; mkdir -p $D
pack() { tar czf $OUT/c6.tgz -C $OUT c6; }  # after each step: a call cut by its limit still brings back what it did
TD=$PWD/benchmarks/results/h100-2026-12-07c-route/tuning
nvidia-smi --query-gpu=name --format=csv,noheader; git log --oneline -1 | cut -c1-80
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gpu_kernels.py tests/kernels/test_stacked_linear.py \
  tests/kernels/test_qkv_rope.py -k "fold or qkv_rope" > $D/gpu-tests.log 2>&1
echo "gpu tests rc=$? at $((SECONDS - T0)) s"; tail -2 $D/gpu-tests.log | cut -c1-200; pack
for arm in default fold fold-rope default fold fold-rope; do
  env=""; [ $arm != default ] && env="STRATA_KERNEL_TUNING=$TD/$arm.json"
  env $env timeout 45 python3 -m benchmarks.decode_bench --model=qwen3-30b-a3b --layers=24 --windows=1 --hf=off \
    --iters=30 --json=$D/window-$arm-$SECONDS.json > $D/window-$arm-$SECONDS.log 2>&1
  echo "window $arm rc=$? at $((SECONDS - T0)) s: $(python3 -c "import json,glob; f=sorted(glob.glob('$D/window-$arm-*.json'))[-1]; r=json.load(open(f))['rows'][0]; print(f\"synced {r['ms_per_step']:.3f} ms, pipelined {r['ms_per_step_pipelined']:.3f} ms\")" 2>&1 | tail -1)"; pack
done
STRATA_KERNEL_TUNING=$TD/fold.json timeout 40 python3 -m benchmarks.profile_window --model=qwen3-30b-a3b --layers=24 \
  --windows=1 --json=$D/profile-fold.json > $D/profile-fold.log 2>&1
echo "profile rc=$? at $((SECONDS - T0)) s"; grep -E "tuning|op time|^\| attention" $D/profile-fold.log | cut -c1-200; pack
Q="temperature=0.7,top_k=20,top_p=0.8"
for arm in default fold; do
  env=""; [ $arm != default ] && env="STRATA_KERNEL_TUNING=$TD/$arm.json"
  env $env timeout 80 python3 -m benchmarks.peer_bench --layers=24 --llama_bench= --reps=3 --ours="spec=0;$Q" \
    --json=$D/p24-$arm.json > $D/p24-$arm.log 2>&1
  echo "loop $arm rc=$? at $((SECONDS - T0)) s"; grep -E "^\| strata|rror" $D/p24-$arm.log | cut -c1-160; pack
done
echo "done at $((SECONDS - T0)) s"
