# Call 1: the exact route's softmax + top-K in one Pallas kernel (route_kernel=pallas, pallas_kernels/route_topk.py)
# against XLA's softmax and sort (route_kernel=xla): its GPU tests (compiled kernel; the engine, all resident and
# offloaded); the 24-layer T=1 window graph (decode_bench, mirrored xla / pallas / xla / pallas); the window's profile
# with it; then the generate loop at 24 layers (peer_bench, no peer: greedy spec=0 and Qwen3's sampling with default
# settings, each with either route).
# CALL / TESTS: call2.sh's (its folder, the tests' -k).
set -u; export PYTHONPATH=. PYTHONUNBUFFERED=1; T0=$SECONDS; C=${CALL:-c1}; D=$OUT/$C; mkdir -p $D
pack() { tar czf $OUT/$C.tgz -C $OUT $C; }  # after each step: a call cut by its limit still brings back what it did
nvidia-smi --query-gpu=name --format=csv,noheader; git log --oneline -1 | cut -c1-80
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gpu_kernels.py tests/engine/test_gpu.py \
  -k "${TESTS:-route or scanned_layers}" > $D/gpu-tests.log 2>&1
echo "gpu tests rc=$? at $((SECONDS - T0)) s"; tail -3 $D/gpu-tests.log | cut -c1-200; pack
for arm in xla pallas xla pallas; do
  timeout 60 python3 -m benchmarks.decode_bench --model=qwen3-30b-a3b --layers=24 --windows=1 --hf=off --iters=30 \
    --route_kernel=$arm --json=$D/window-$arm-$SECONDS.json > $D/window-$arm-$SECONDS.log 2>&1
  echo "window route=$arm rc=$? at $((SECONDS - T0)) s: $(python3 -c "import json,glob; f=sorted(glob.glob('$D/window-$arm-*.json'))[-1]; r=json.load(open(f))['rows'][0]; print(f\"synced {r['ms_per_step']:.3f} ms, pipelined {r['ms_per_step_pipelined']:.3f} ms\")" 2>&1 | tail -1)"; pack
done
timeout 45 python3 -m benchmarks.profile_window --model=qwen3-30b-a3b --layers=24 --windows=1 --route_kernel=pallas \
  --json=$D/profile-route.json > $D/profile-route.log 2>&1
echo "profile rc=$? at $((SECONDS - T0)) s"; grep -E "op time|moe_route" $D/profile-route.log | cut -c1-200; pack
Q="temperature=0.7,top_k=20,top_p=0.8"
timeout $((590 - (SECONDS - T0))) python3 -m benchmarks.peer_bench --layers=24 --llama_bench= --reps=3 \
  --ours="spec=0,route_kernel=xla;spec=0,route_kernel=pallas;$Q,route_kernel=xla;$Q,route_kernel=pallas" --json=$D/p24.json > $D/p24.log 2>&1
echo "loop rc=$? at $((SECONDS - T0)) s"; grep -E "^\| strata|rror" $D/p24.log | cut -c1-160; pack
echo "done at $((SECONDS - T0)) s"
