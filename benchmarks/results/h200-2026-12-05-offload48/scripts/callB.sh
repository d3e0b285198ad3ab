# Call B: llama.cpp on 48 layers of the 30B shape (the whole model): its F16 GGUF (61 GB) written to /dev/shm, then
# llama-bench all on the GPU and at -ncmoe 24 / 36 (50% / 25% of the expert bytes on the GPU); the GGUF removed after.
# The build of call A is reused when the machine stayed warm; else it is built again first.
set -u; export PYTHONPATH=. PYTHONUNBUFFERED=1
R=$OUT/callB; mkdir -p $R; LLAMA=/tmp/llama.cpp; T0=$SECONDS
free -g | head -2; df -h /dev/shm | tail -1
if [ ! -x $LLAMA/build/bin/llama-bench ]; then
  echo "no build here: building (call A's machine went back)"
  bash benchmarks/peer/build_llama.sh "$PWD/.peer/llama.tar.xz" $LLAMA > $R/build.log 2>&1; echo "build rc=$? at $((SECONDS - T0)) s"
fi
rm -f /tmp/qwen3-30b-a3b-12.gguf
timeout 200 python3 benchmarks/peer/write_gguf.py --out=/dev/shm/qwen3-30b-a3b-48.gguf --model=qwen3-30b-a3b --layers=48 \
  --gguf_py=$LLAMA/gguf-py > $R/gguf.log 2>&1; echo "gguf rc=$? at $((SECONDS - T0)) s"; ls -la /dev/shm; free -g | head -2
timeout $((580 - (SECONDS - T0))) python3 -m benchmarks.peer_bench --layers=48 --llama_bench=$LLAMA/build/bin/llama-bench \
  --gguf=/dev/shm/qwen3-30b-a3b-48.gguf --gguf_py=$LLAMA/gguf-py --ncmoe=24,36 --reps=3 --ours="" \
  --json=$R/peer48.json > $R/peer48.log 2>&1
echo "peer48 rc=$? at $((SECONDS - T0)) s"; grep -E "^\||peer:|error|Error" $R/peer48.log | tail -14
rm -f /dev/shm/qwen3-30b-a3b-48.gguf
