# Call C (same warm machine): issues 33 / 34 in one run beside llama.cpp on the F16 file (bf16, spread routing): PCIe
# only and the host pool alone at 64 / 32 slots (-ncmoe 6 / 9), temperature 1, no drafts; the warm-up arm first.
set -u; export PYTHONPATH=. PYTHONUNBUFFERED=1; L=/tmp/llama.cpp; T0=$SECONDS; T1="spec=0,temperature=1"
timeout 530 python3 -m benchmarks.peer_bench --layers=12 --gguf=/dev/shm/qwen3-30b-a3b-12.gguf \
  --llama_bench=$L/build/bin/llama-bench --gguf_py=$PWD/.peer/wheels/gguf-0.19.0-py3-none-any.whl --ncmoe=6,9 \
  --embed_scale=50 --reps=2 --json=$OUT/peer12.json \
  --ours="expert_cache_slots=32,pcie_frac=1,$T1;expert_cache_slots=64,pcie_frac=0,$T1;expert_cache_slots=64,pcie_frac=1,$T1" \
  > $OUT/peer12.log 2>&1
echo "peer12 rc=$? at $((SECONDS - T0)) s"; grep -E "^\||error|Error|pcie_frac: | ours \[| peer: " $OUT/peer12.log | cut -c1-240 | tail -30
