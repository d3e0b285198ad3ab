# Call 4: the q/k/v product's epilogue in one kernel (pallas_kernels/qkv_rope.py: split sum, q/k norms, RoPE, K/V rows
# written in place; switched on by ../tuning/qkv-rope.json) against XLA's ops: its GPU tests; the 24-layer T=1 window
# graph (decode_bench), default / fused mirrored, and fused with route_kernel=pallas; the fused window's profile; the
# generate loop at 24 layers (greedy spec=0 and Qwen3's sampling with default settings), default and fused.
set -u; export PYTHONPATH=. PYTHONUNBUFFERED=1; T0=$SECONDS; D=$OUT/c4; mkdir -p $D
pack() { tar czf $OUT/c4.tgz -C $OUT c4; }  # after each step: a call cut by its limit still brings back what it did
F=$PWD/benchmarks/results/h100-2026-12-07c-route/tuning/qkv-rope.json
nvidia-smi --query-gpu=name --format=csv,noheader; git log --oneline -1 | cut -c1-80
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gpu_kernels.py tests/kernels/test_qkv_rope.py \
  tests/engine/test_gpu.py -k "qkv_rope or scanned or scanned_layers" > $D/gpu-tests.log 2>&1
echo "gpu tests rc=$? at $((SECONDS - T0)) s"; tail -3 $D/gpu-tests.log | cut -c1-200; pack
for arm in default fused default fused fused-route; do
  env=""; case $arm in fused*) env="STRATA_KERNEL_TUNING=$F";; esac
  route=xla; [ $arm = fused-route ] && route=pallas
  env $env timeout 60 python3 -m benchmarks.decode_bench --model=qwen3-30b-a3b --layers=24 --windows=1 --hf=off \
    --iters=30 --route_kernel=$route --json=$D/window-$arm-$SECONDS.json > $D/window-$arm-$SECONDS.log 2>&1
  echo "window $arm rc=$? at $((SECONDS - T0)) s: $(python3 -c "import json,glob; f=sorted(glob.glob('$D/window-$arm-*.json'))[-1]; r=json.load(open(f))['rows'][0]; print(f\"synced {r['ms_per_step']:.3f} ms, pipelined {r['ms_per_step_pipelined']:.3f} ms\")" 2>&1 | tail -1)"; pack
done
STRATA_KERNEL_TUNING=$F timeout 45 python3 -m benchmarks.profile_window --model=qwen3-30b-a3b --layers=24 --windows=1 \
  --json=$D/profile-fused.json > $D/profile-fused.log 2>&1
echo "profile rc=$? at $((SECONDS - T0)) s"; grep -E "tuning|op time|^\| attention" $D/profile-fused.log | cut -c1-200; pack
Q="temperature=0.7,top_k=20,top_p=0.8"
for arm in default fused; do
  env=""; [ $arm = fused ] && env="STRATA_KERNEL_TUNING=$F"
  left=$((590 - (SECONDS - T0))); [ $arm = default ] && left=$((left / 2))
  env $env timeout $left python3 -m benchmarks.peer_bench --layers=24 \
    --llama_bench= --reps=3 --ours="spec=0;$Q" --json=$D/p24-$arm.json > $D/p24-$arm.log 2>&1
  echo "loop $arm rc=$? at $((SECONDS - T0)) s"; grep -E "^\| strata|rror|kernel tuning" $D/p24-$arm.log | cut -c1-160; pack
done
echo "done at $((SECONDS - T0)) s"
