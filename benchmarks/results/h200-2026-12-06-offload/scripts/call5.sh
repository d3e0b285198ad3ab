# Call 5 (same warm H100 machine, llama.cpp built in call 2): PCIe only without drafts at temperature 1 beside
# llama.cpp -ncmoe 6 / 9 in one process.
export PYTHONPATH=. PYTHONUNBUFFERED=1; L=/tmp/llama.cpp
timeout 225 python3 -m benchmarks.peer_bench --layers=12 --llama_bench=$L/build/bin/llama-bench --gguf_py=$L/gguf-py \
  --ncmoe=6,9 --embed_scale=50 --reps=2 \
  --ours="expert_cache_slots=64,pcie_frac=1,spec=0,temperature=1;expert_cache_slots=32,pcie_frac=1,spec=0,temperature=1" \
  --json=$OUT/peer12_pcie.json > $OUT/peer12_pcie.log 2>&1
echo "rc=$?"; grep -E "^\||rror" $OUT/peer12_pcie.log | cut -c1-200
