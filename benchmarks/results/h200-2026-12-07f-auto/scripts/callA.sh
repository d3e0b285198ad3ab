# Call A (issues 33 / 34; the twelfth session's callA.sh again): the peer's llama-bench built (setsid, it outlives the call) and the 12-layer F16 GGUF
# written to /dev/shm, for call B to run at once on the same warm machine. Meanwhile the offload GPU tests (the
# slots' refill after a prefill and slot_refresh changed since they last ran on a GPU).
set -u; export PYTHONPATH=. PYTHONUNBUFFERED=1; L=/tmp/llama.cpp; T0=$SECONDS; D=$OUT/cA; mkdir -p $D
G=/dev/shm/qwen3-30b-a3b-12.gguf; WHEEL=$PWD/.peer/wheels/gguf-0.19.0-py3-none-any.whl
nvidia-smi --query-gpu=name --format=csv,noheader; lscpu | grep -E "Model name|^CPU\(s\)"; git log --oneline -1 | cut -c1-80
ls -la .peer/llama.tar.xz $WHEEL || exit 3
rm -f $L.done /tmp/gguf.done
BUILD_TARGETS=llama-bench setsid nohup bash benchmarks/peer/build_llama.sh "$PWD/.peer/llama.tar.xz" $L > /dev/null 2>&1 < /dev/null &
setsid nohup bash -c "python3 benchmarks/peer/write_gguf.py --out=$G.part --model=qwen3-30b-a3b --layers=12 \
  --gguf_py=$WHEEL > /tmp/gguf.log 2>&1 && mv $G.part $G; echo rc=\$? > /tmp/gguf.done" > /dev/null 2>&1 < /dev/null &
timeout 300 python3 -m pytest -q -p no:cacheprovider -o console_output_style=classic tests/offload/test_offload.py \
  tests/engine/test_gpu.py > $D/gpu-tests.log 2>&1
echo "gpu tests rc=$? at $((SECONDS - T0)) s"; tail -3 $D/gpu-tests.log | cut -c1-200
grep -E "FAILED|Error" $D/gpu-tests.log | head -10 | cut -c1-200
while { [ ! -f $L.done ] || [ ! -f /tmp/gguf.done ]; } && [ $((SECONDS - T0)) -lt 560 ]; do sleep 2; done
echo "build: $(cat $L.done 2>/dev/null || echo not done); gguf: $(cat /tmp/gguf.done 2>/dev/null || echo not done) at $((SECONDS - T0)) s"
tail -3 $L.log | cut -c1-200; ls -la $L/build/bin/llama-bench $G 2>&1 | cut -c1-150
tar czf $OUT/cA.tgz -C $OUT cA
