# Calls 1b-1d (the same warm machine as call 1, chained): issue 39's arms one engine a process (two engines of 24
# layers do not fit an 80 GB H100 in one process before the fix in benchmarks/common.py), then the sweep alone.
export PYTHONPATH=.:$PWD/.peer/wheels/gguf-0.19.0-py3-none-any.whl PYTHONUNBUFFERED=1; L=/tmp/llama.cpp
G=/dev/shm/qwen3-30b-a3b-24.gguf; Q="temperature=0.7,top_k=20,top_p=0.8"
# 1b
timeout 200 python3 -m benchmarks.peer_bench --layers=24 --gguf=$G --llama_bench=$L/build/bin/llama-bench \
  --gguf_py=$PWD/.peer/wheels/gguf-0.19.0-py3-none-any.whl --reps=3 --peer_sampling=$Q --ours="$Q" --warmup_arm=false \
  --json=$OUT/peer24-sampled.json > $OUT/peer24-sampled.log 2>&1
timeout 130 python3 -m benchmarks.peer_bench --layers=24 --llama_bench= --reps=3 --ours="default" --warmup_arm=false \
  --json=$OUT/peer24-greedy.json > $OUT/peer24-greedy.log 2>&1
# 1c
for a in "$Q,spec=0" "spec=0" "$Q"; do n=$(echo "$a" | tr ',=.' '___')
  timeout 100 python3 -m benchmarks.peer_bench --layers=24 --llama_bench= --reps=3 --ours="$a" --warmup_arm=false \
    --json=$OUT/p24-$n.json > $OUT/p24-$n.log 2>&1; done
# 1d
SWEEP_S=190 timeout 245 python3 benchmarks/results/h200-2026-12-06g-sampling/scripts/kernel_sweep.py $OUT/sweep2.json \
  > $OUT/sweep2.log 2>&1
