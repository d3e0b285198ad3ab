# Call 2 (the same warm machine as call 1, llama.cpp and the 24-layer F16 GGUF made there): issue 39's figures at 24
# layers, all resident, in one process: our generate loop greedy and with Qwen3's sampling (temperature 0.7, top_k 20,
# top_p 0.8), default settings and spec=0, beside llama.cpp's greedy tg128 (llama-bench) and its sampled
# llama-completion with the same settings.
set -u; export PYTHONPATH=.:$PWD/.peer/wheels/gguf-0.19.0-py3-none-any.whl PYTHONUNBUFFERED=1; L=/tmp/llama.cpp; T0=$SECONDS
G=/dev/shm/qwen3-30b-a3b-24.gguf; Q="temperature=0.7,top_k=20,top_p=0.8"
nvidia-smi --query-gpu=name --format=csv,noheader; git log --oneline -1 | cut -c1-80
while { [ ! -f $L.done ] || [ ! -f /tmp/gguf.done ]; } && [ $((SECONDS - T0)) -lt 240 ]; do sleep 3; done
echo "build: $(cat $L.done 2>/dev/null || echo not done); gguf: $(cat /tmp/gguf.done 2>/dev/null || echo not done) at $((SECONDS - T0)) s"
tail -2 $L.log | cut -c1-200; tail -2 /tmp/gguf.log | cut -c1-200; ls -la /dev/shm/ | grep gguf
timeout $((585 - (SECONDS - T0))) python3 -m benchmarks.peer_bench --layers=24 --gguf=$G \
  --llama_bench=$L/build/bin/llama-bench --gguf_py=$PWD/.peer/wheels/gguf-0.19.0-py3-none-any.whl --reps=3 \
  --peer_sampling=$Q --ours="default;$Q;spec=0;$Q,spec=0" --json=$OUT/peer24.json > $OUT/peer24.log 2>&1
echo "peer24 rc=$? at $((SECONDS - T0)) s"; grep -E "^\||error|Error| ours \[| peer: " $OUT/peer24.log | cut -c1-260 | tail -30
cd $OUT && tar czf call2.tgz *.log *.json 2>/dev/null; ls $OUT
