# Call 2 (the same warm machine as call 1: llama.cpp, the 24-layer F16 GGUF and the sweep's JSON made there): issue
# 39's figures at 24 layers, all resident: our generate loop greedy and with Qwen3's sampling (temperature 0.7, top_k
# 20, top_p 0.8) with default settings, beside llama.cpp's greedy tg128 (llama-bench) and its sampled
# llama-completion with the same settings, in one process; then, another process, the same arms and spec=0 with the
# sweep's kernel tuning in place of the kernels' defaults (tuned_run.py; no peer).
set -u; export PYTHONPATH=.:$PWD/.peer/wheels/gguf-0.19.0-py3-none-any.whl PYTHONUNBUFFERED=1; L=/tmp/llama.cpp; T0=$SECONDS
G=/dev/shm/qwen3-30b-a3b-24.gguf; Q="temperature=0.7,top_k=20,top_p=0.8"; S=benchmarks/results/h200-2026-12-06g-sampling/scripts
nvidia-smi --query-gpu=name --format=csv,noheader; git log --oneline -1 | cut -c1-80
while { [ ! -f $L.done ] || [ ! -f /tmp/gguf.done ]; } && [ $((SECONDS - T0)) -lt 200 ]; do sleep 3; done
echo "build: $(cat $L.done 2>/dev/null || echo not done); gguf: $(cat /tmp/gguf.done 2>/dev/null || echo not done) at $((SECONDS - T0)) s"
timeout 280 python3 -m benchmarks.peer_bench --layers=24 --gguf=$G \
  --llama_bench=$L/build/bin/llama-bench --gguf_py=$PWD/.peer/wheels/gguf-0.19.0-py3-none-any.whl --reps=3 \
  --peer_sampling=$Q --ours="default;$Q" --json=$OUT/peer24.json > $OUT/peer24.log 2>&1
echo "peer24 rc=$? at $((SECONDS - T0)) s"; grep -E "^\||error|Error" $OUT/peer24.log | cut -c1-260 | tail -14
timeout $((585 - (SECONDS - T0))) python3 $S/tuned_run.py /tmp/sweep.json benchmarks.peer_bench --layers=24 \
  --llama_bench= --reps=3 --ours="default;$Q;spec=0" --json=$OUT/peer24-tuned.json > $OUT/peer24-tuned.log 2>&1
echo "tuned rc=$? at $((SECONDS - T0)) s"; grep -E "^\||error|Error|tuned kernels" $OUT/peer24-tuned.log | cut -c1-260 | tail -12
cd $OUT && tar czf call2.tgz *.log *.json 2>/dev/null; ls $OUT
