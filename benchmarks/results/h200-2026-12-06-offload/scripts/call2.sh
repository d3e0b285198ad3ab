# Call 2: the peer builds (setsid, all cores) and the 12-layer F16 GGUF is written after it, while the offload GPU
# tests run (correctness only); then llama.cpp and our generate loop on 12 layers of the 30B shape in one process
# (peer_bench, routing spread): all on the GPU, -ncmoe 6 / 9 (50% / 25% of the expert bytes on the GPU) beside 64 / 32
# slots of 128: default settings, and the host pool alone (static slots, pcie_frac 0, temperature 1, no drafts).
set -u; export PYTHONPATH=. PYTHONUNBUFFERED=1; R=$OUT; LLAMA=/tmp/llama.cpp; T0=$SECONDS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; lscpu | grep -E "Model name"
setsid nohup bash benchmarks/peer/build_llama.sh "$PWD/.peer/llama.tar.xz" $LLAMA > /dev/null 2>&1 < /dev/null &
setsid nohup bash -c "while [ ! -d $LLAMA/gguf-py ]; do sleep 2; done; python3 benchmarks/peer/write_gguf.py \
  --out=/tmp/gguf.part --model=qwen3-30b-a3b --layers=12 --gguf_py=$LLAMA/gguf-py > /tmp/gguf.log 2>&1 \
  && mv /tmp/gguf.part /tmp/qwen3-30b-a3b-12.gguf; echo rc=\$? > /tmp/gguf.done" > /dev/null 2>&1 < /dev/null &
TESTS_COMPILE_GRAPHS=lazy timeout 200 python3 -m pytest -v -p no:cacheprovider -o console_output_style=classic \
  -k "offload_is_exact or blocks_of_experts or fetch_by_the_worker or pool_failure" tests/engine/test_gpu.py > $R/tests.log 2>&1
echo "tests rc=$? at $((SECONDS - T0)) s"; grep -E "PASS|FAIL|ERROR|passed|failed" $R/tests.log | cut -c1-150 | tail -12
while { [ ! -f $LLAMA.done ] || [ ! -f /tmp/gguf.done ]; } && [ $((SECONDS - T0)) -lt 380 ]; do sleep 3; done
echo "build: $(cat $LLAMA.done 2>/dev/null || echo not done: $(tail -1 $LLAMA.log | cut -c1-80)); gguf: $(cat /tmp/gguf.done 2>/dev/null) at $((SECONDS - T0)) s"
T1="spec=0,temperature=1"
timeout $((590 - (SECONDS - T0))) python3 -m benchmarks.peer_bench --layers=12 --llama_bench=$LLAMA/build/bin/llama-bench \
  --gguf_py=$LLAMA/gguf-py --ncmoe=6,9 --embed_scale=50 --reps=3 \
  --ours="expert_cache_slots=64;expert_cache_slots=32;expert_cache_slots=64,cache_policy=static,pcie_frac=0,$T1;expert_cache_slots=32,cache_policy=static,pcie_frac=0,$T1" \
  --json=$R/peer12.json > $R/peer12.log 2>&1
echo "peer12 rc=$? at $((SECONDS - T0)) s"; grep -E "^\||error|Error" $R/peer12.log | cut -c1-200 | tail -12
