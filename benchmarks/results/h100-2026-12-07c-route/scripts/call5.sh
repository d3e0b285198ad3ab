# Call 5: qkv_rope with the norms read at the layer in place and RoPE's tables made in the kernel (call 4's form
# sliced the norms out of the stacks and padded cos / sin: four ops a layer more, 2,539 against 2,489 us a window):
# its compiled GPU test; the 24-layer T=1 window, default / fused mirrored; the fused window's profile; the generate
# loop at 24 layers, greedy spec=0, default and fused.
set -u; export PYTHONPATH=. PYTHONUNBUFFERED=1; T0=$SECONDS; D=$OUT/c5; mkdir -p $D
pack() { tar czf $OUT/c5.tgz -C $OUT c5; }  # after each step: a call cut by its limit still brings back what it did
F=$PWD/benchmarks/results/h100-2026-12-07c-route/tuning/qkv-rope.json
nvidia-smi --query-gpu=name --format=csv,noheader; git log --oneline -1 | cut -c1-80
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gpu_kernels.py -k qkv_rope > $D/gpu-tests.log 2>&1
echo "gpu tests rc=$? at $((SECONDS - T0)) s"; tail -2 $D/gpu-tests.log | cut -c1-200; pack
for arm in default fused default fused; do
  env=""; [ $arm = fused ] && env="STRATA_KERNEL_TUNING=$F"
  env $env timeout 45 python3 -m benchmarks.decode_bench --model=qwen3-30b-a3b --layers=24 --windows=1 --hf=off \
    --iters=30 --json=$D/window-$arm-$SECONDS.json > $D/window-$arm-$SECONDS.log 2>&1
  echo "window $arm rc=$? at $((SECONDS - T0)) s: $(python3 -c "import json,glob; f=sorted(glob.glob('$D/window-$arm-*.json'))[-1]; r=json.load(open(f))['rows'][0]; print(f\"synced {r['ms_per_step']:.3f} ms, pipelined {r['ms_per_step_pipelined']:.3f} ms\")" 2>&1 | tail -1)"; pack
done
STRATA_KERNEL_TUNING=$F timeout 40 python3 -m benchmarks.profile_window --model=qwen3-30b-a3b --layers=24 --windows=1 \
  --json=$D/profile-fused.json > $D/profile-fused.log 2>&1
echo "profile rc=$? at $((SECONDS - T0)) s"; grep -E "op time|^\| attention" $D/profile-fused.log | cut -c1-200; pack
for arm in default fused; do
  env=""; [ $arm = fused ] && env="STRATA_KERNEL_TUNING=$F"
  env $env timeout 60 python3 -m benchmarks.peer_bench --layers=24 --llama_bench= --reps=3 --ours="spec=0" \
    --warmup_arm=false --json=$D/p24-$arm.json > $D/p24-$arm.log 2>&1
  echo "loop $arm rc=$? at $((SECONDS - T0)) s"; grep -E "^\| strata|rror" $D/p24-$arm.log | cut -c1-160; pack
done
echo "done at $((SECONDS - T0)) s"
