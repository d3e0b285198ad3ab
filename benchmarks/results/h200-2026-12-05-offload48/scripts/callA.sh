# Call A: the peer builds (setsid, nice 19) and the 12-layer F16 GGUF is written while the GPU offload tests run (no
# timing beside the build); then, the build done, llama.cpp and our generate loop on 12 layers of the 30B shape in one
# process (peer_bench): -ncmoe 6 / 9 (50% / 25% of the expert bytes on the GPU) beside 64 / 32 slots of 128.
set -u; export PYTHONPATH=. PYTHONUNBUFFERED=1
R=$OUT/callA; mkdir -p $R; LLAMA=/tmp/llama.cpp; T0=$SECONDS
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader; nproc; free -g | head -2; df -h /dev/shm /tmp | tail -2
setsid nohup nice -n 19 bash benchmarks/peer/build_llama.sh "$PWD/.peer/llama.tar.xz" $LLAMA > /dev/null 2>&1 < /dev/null &
setsid nohup nice -n 19 bash -c "while [ ! -d $LLAMA/gguf-py ]; do sleep 2; done; python3 benchmarks/peer/write_gguf.py \
  --out=/tmp/gguf.part --model=qwen3-30b-a3b --layers=12 --gguf_py=$LLAMA/gguf-py > /tmp/gguf.log 2>&1 \
  && mv /tmp/gguf.part /tmp/qwen3-30b-a3b-12.gguf; echo rc=\$? > /tmp/gguf.done" > /dev/null 2>&1 < /dev/null &
timeout 230 python3 -m pytest -q -p no:cacheprovider -k "offload or pallas_expert or pinned or blocks" tests/test_gpu.py \
  > $R/tests.log 2>&1; echo "tests rc=$? at $((SECONDS - T0)) s"; tail -4 $R/tests.log
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_quant.py -k quantized_kernel_in_the_engine_on_the_gpu \
  > $R/tests_quant.log 2>&1; echo "quant tests rc=$? at $((SECONDS - T0)) s"; tail -3 $R/tests_quant.log
while { [ ! -f $LLAMA.done ] || [ ! -f /tmp/gguf.done ]; } && [ $((SECONDS - T0)) -lt 330 ]; do sleep 3; done
echo "build: $(cat $LLAMA.done 2>/dev/null || echo not done: $(tail -1 $LLAMA.log | cut -c1-80)); gguf: $(cat /tmp/gguf.done 2>/dev/null) at $((SECONDS - T0)) s"
timeout $((585 - (SECONDS - T0))) python3 -m benchmarks.peer_bench --layers=12 --llama_bench=$LLAMA/build/bin/llama-bench \
  --gguf_py=$LLAMA/gguf-py --ncmoe=6,9 --embed_scale=50 --reps=3 \
  --ours="expert_cache_slots=64;expert_cache_slots=32;expert_cache_slots=64,pcie_frac=1,spec=0;expert_cache_slots=32,pcie_frac=1,spec=0" \
  --json=$R/peer12.json > $R/peer12.log 2>&1
echo "peer12 rc=$? at $((SECONDS - T0)) s"; grep -E "^\||compil|error|Error" $R/peer12.log | tail -24
