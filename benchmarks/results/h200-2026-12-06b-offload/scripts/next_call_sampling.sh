# For a next GPU session (written 2026-12-06, not run): issue 39's gap at 12 layers isolated, one process, no peer
# (~4 min). Call C measured the Qwen3 sampling request (0.7 / 20 / 0.8, default settings) at 578.9 tok/s where
# offload_bench's all-resident arm (temperature 1, no filter, default settings) ran 756-762 the same day: the filter
# form, the drafted windows, or the arms' other settings (64 against 128 tokens).
set -u; export PYTHONPATH=. PYTHONUNBUFFERED=1
Q="temperature=0.7,top_k=20,top_p=0.8"
timeout 280 python3 -m benchmarks.peer_bench --layers=12 --llama_bench= --reps=3 --embed_scale=50 \
  --ours="default;spec=0;$Q;$Q,spec=0;temperature=1;temperature=1,spec=0;temperature=0.7,top_p=0.8,spec=0;temperature=0.7,top_k=20,spec=0" \
  --json=$OUT/sampling12.json > $OUT/sampling12.log 2>&1
echo "rc=$?"; grep -E "^\||rror" $OUT/sampling12.log | cut -c1-200
