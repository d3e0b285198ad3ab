# Call E1 (issue 34's 48 layers beside the peer; prepared, not run this session): llama-bench built (setsid) and the
# 48-layer F16 GGUF of the 30B shape (61 GB) written to /dev/shm (setsid: both outlive the call), then waited for.
# Run with carry=[".peer/llama.tar.xz", ".peer/wheels/gguf-0.19.0-py3-none-any.whl"]; callE2.sh right after it on the
# warm machine. If the call ends first, callE2.sh waits for the files.
set -u; export PYTHONPATH=. PYTHONUNBUFFERED=1; L=/tmp/llama.cpp; T0=$SECONDS; D=$OUT/cE1; mkdir -p $D
G=/dev/shm/qwen3-30b-a3b-48.gguf; WHEEL=$PWD/.peer/wheels/gguf-0.19.0-py3-none-any.whl
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; lscpu | grep -E "Model name|^CPU\(s\)"; free -g | head -2
ls -la .peer/llama.tar.xz $WHEEL || exit 3
rm -f $L.done /tmp/gguf48.done
BUILD_TARGETS=llama-bench setsid nohup bash benchmarks/peer/build_llama.sh "$PWD/.peer/llama.tar.xz" $L > /dev/null 2>&1 < /dev/null &
setsid nohup bash -c "python3 benchmarks/peer/write_gguf.py --out=$G.part --model=qwen3-30b-a3b --layers=48 \
  --gguf_py=$WHEEL > /tmp/gguf48.log 2>&1 && mv $G.part $G; echo rc=\$? > /tmp/gguf48.done" > /dev/null 2>&1 < /dev/null &
while { [ ! -f $L.done ] || [ ! -f /tmp/gguf48.done ]; } && [ $((SECONDS - T0)) -lt 570 ]; do sleep 5; done
echo "build: $(cat $L.done 2>/dev/null || echo not done); gguf: $(cat /tmp/gguf48.done 2>/dev/null || echo not done) at $((SECONDS - T0)) s"
tail -2 /tmp/gguf48.log | cut -c1-200; ls -la $L/build/bin/llama-bench $G* 2>&1 | cut -c1-150; free -g | head -2
