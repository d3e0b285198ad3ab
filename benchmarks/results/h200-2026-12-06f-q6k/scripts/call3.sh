# Call 3 (same warm machine as call 2): both llama-quantize types of the 12-layer 30B shape, llama.cpp (all on the
# GPU, -ncmoe 6 / 9: 50% / 25% of the expert bytes on the GPU) and our generate loop with default settings at 64 / 32
# of 128 slots, both reading the same file; our down experts now packed (Q2_K file: int6-q6k; Q4_K_M: int6-q6km).
set -u; export PYTHONPATH=.:$PWD/.peer/wheels/gguf-0.19.0-py3-none-any.whl PYTHONUNBUFFERED=1; L=/tmp/llama.cpp; T0=$SECONDS
Q=${Q:-Q4_K_M,Q2_K}; G=/dev/shm/qwen3-30b-a3b-12.gguf
while [ "$(wc -l < /tmp/quant.done 2>/dev/null || echo 0)" -lt 2 ] && [ $((SECONDS - T0)) -lt 170 ]; do sleep 3; done
cat /tmp/quant.done 2>/dev/null; ls -la /dev/shm/ | grep gguf
timeout $((588 - (SECONDS - T0))) python3 -m benchmarks.peer_bench --layers=12 --gguf=$G --quant=$Q \
  --llama_bench=$L/build/bin/llama-bench --gguf_py=$PWD/.peer/wheels/gguf-0.19.0-py3-none-any.whl --ncmoe=6,9 --reps=2 \
  --ours="expert_cache_slots=64;expert_cache_slots=32" --json=$OUT/peer-quant.json > $OUT/peer-quant.log 2>&1
echo "peer rc=$? at $((SECONDS - T0)) s"; grep -E "^\||error|Error|gguf: |pcie_frac: | ours \[| peer: " $OUT/peer-quant.log | cut -c1-260 | tail -30
echo "done at $((SECONDS - T0)) s"
