# Call 3: the plan without sorts or scatters (795c1c9) measured: offload_bench on 12 layers, S=E / 50% / 25% PCIe only
# beside all resident (the fixed cost a layer; the share of the bytes bound), int4 experts at 25%; then our 48-layer
# engine with 32 slots of 128 (its start-up compile: scanned offload graphs, T=1..4 and the prefill chunks).
# As run: the int4 step skipped (`true ||`, the device time left) and the 48-layer limit 470 s; int4 ran in call 4.
set -u; export PYTHONPATH=. PYTHONUNBUFFERED=1; R=$OUT; T0=$SECONDS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; lscpu | grep -E "Model name"
timeout 200 python3 -m benchmarks.offload_bench --model=qwen3-30b-a3b --layers=12 --slot_fracs=1.0,0.5,0.25 \
  --pcie_fracs=1 --embed_scale=50 --new_tokens=64 --json=$R/offload.json > $R/offload.log 2>&1
echo "offload rc=$? at $((SECONDS - T0)) s"; grep -E "^\| (all|S=)|rror" $R/offload.log | cut -c1-250
true || timeout 120 python3 -m benchmarks.offload_bench --model=qwen3-30b-a3b --layers=12 --slot_fracs=0.25 --pcie_fracs=1 \
  --expert_dtype=int4 --embed_scale=50 --new_tokens=64 --json=$R/offload_int4.json > $R/offload_int4.log 2>&1
echo "int4 rc=$? at $((SECONDS - T0)) s"; grep -E "^\| (all|S=)|rror" $R/offload_int4.log | cut -c1-250
timeout $((470 - (SECONDS - T0))) python3 -m benchmarks.peer_bench --layers=48 --llama_bench= --embed_scale=50 --reps=2 \
  --ours="expert_cache_slots=32" --json=$R/ours48.json > $R/ours48.log 2>&1
echo "ours48 rc=$? at $((SECONDS - T0)) s"; grep -E "^\||compil|graphs:|rror" $R/ours48.log | cut -c1-220 | tail -12
