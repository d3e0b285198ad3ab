# Call C: our generate loop on 48 layers of the 30B shape (the whole model, 58 GB of bf16 experts), routing spread
# (embed_scale 50): all resident, then 64 / 32 slots of 128 with default settings and PCIe only without drafts. Each
# arm a fresh engine: its start-up and compile time (the scanned offload graphs, prefill included) in the table.
set -u; export PYTHONPATH=. PYTHONUNBUFFERED=1
R=$OUT/callC; mkdir -p $R; T0=$SECONDS
rm -f /dev/shm/*.gguf /tmp/*.gguf; free -g | head -2
timeout 585 python3 -m benchmarks.peer_bench --layers=48 --llama_bench= --embed_scale=50 --reps=3 \
  --ours="expert_cache_slots=64;expert_cache_slots=32;default;expert_cache_slots=64,pcie_frac=1,spec=0;expert_cache_slots=32,pcie_frac=1,spec=0" \
  --json=$R/ours48.json > $R/ours48.log 2>&1
echo "ours48 rc=$? at $((SECONDS - T0)) s"; grep -E "^\||ours \[|compil|graphs:|error|Error" $R/ours48.log | tail -30
