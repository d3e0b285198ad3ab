# Call D (same warm machine): the host pool holding int4-q4k / int2-q2k packed (the file's 4.5 / 2.625 bits a
# weight): its C kernel's tests and per-expert times on the 16-core host, then Q4_K_M's pool alone at 32 slots.
set -u; export PYTHONPATH=.:$PWD/.peer/wheels/gguf-0.19.0-py3-none-any.whl PYTHONUNBUFFERED=1; L=/tmp/llama.cpp; T0=$SECONDS
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/host_pool/test_host_pool_packed.py > $OUT/packed_tests.log 2>&1
echo "tests rc=$? at $((SECONDS - T0)) s: $(tail -1 $OUT/packed_tests.log | cut -c1-160)"
timeout 90 python3 -m strata_jax.host_pool.measure --formats bf16,int4-q4k,int2-q2k --threads 16 > $OUT/measure.log 2>&1
echo "measure rc=$?"; tail -12 $OUT/measure.log | cut -c1-200
timeout $((420 - (SECONDS - T0))) python3 -m benchmarks.peer_bench --layers=12 --gguf=/dev/shm/qwen3-30b-a3b-12.gguf --quant=Q4_K_M \
  --llama_bench=$L/build/bin/llama-bench --gguf_py=$PWD/.peer/wheels/gguf-0.19.0-py3-none-any.whl --ncmoe=9 --reps=2 \
  --ours="expert_cache_slots=32,pcie_frac=0;expert_cache_slots=32,pcie_frac=1" --json=$OUT/peer-pool.json > $OUT/peer-pool.log 2>&1
echo "peer rc=$? at $((SECONDS - T0)) s"; grep -E "^\||error|Error| ours \[" $OUT/peer-pool.log | cut -c1-260 | tail -12
