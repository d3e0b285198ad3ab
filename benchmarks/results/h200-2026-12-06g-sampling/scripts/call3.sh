# Call 3 (optional, if device time is left; the sixth session's prepared call 4): where the server's 8-client streams
# lose against batch_bench's windows, and whether the host pool serves an offloaded batch. (a) batch_bench in process, B = 1 / 8 / 16, all resident; (b) the
# server, all resident, 1 / 8 / 16 clients of one request each (128 + 256 tokens: the streams after every newcomer
# has joined, fewer admissions between windows); (c) the server with 25% of the experts in slots, pcie_frac=auto
# (the pool takes a share of each window's misses, read once for every row) against the sixth session's PCIe only.
set -u; export PYTHONUNBUFFERED=1; T0=$SECONDS
nvidia-smi --query-gpu=name --format=csv,noheader; lscpu | grep -E "Model name|^CPU\(s\)"; git log --oneline -1 | cut -c1-80
python3 -m pip install -q --no-index --find-links .peer/wheels/serve --target /tmp/serve-site fastapi uvicorn \
  sse-starlette openai > /tmp/pip.log 2>&1; echo "pip rc=$? at $((SECONDS - T0)) s"
export PYTHONPATH=.:/tmp/serve-site
timeout 120 python3 -m benchmarks.batch_bench --model=qwen3-30b-a3b --layers=12 --batch=1,8,16 --prompt=128 \
  --new_tokens=128 > $OUT/batch.log 2>&1
echo "batch rc=$? at $((SECONDS - T0)) s"; grep -E "^\||rror" $OUT/batch.log | cut -c1-200 | tail -8
timeout 150 python3 -m benchmarks.serve_bench --model=qwen3-30b-a3b --layers=12 --clients=1,8,16 --requests=1 \
  --prompt=128 --new_tokens=256 --expert_cache_slots=all --json=$OUT/serve-long.json > $OUT/serve-long.log 2>&1
echo "serve long rc=$? at $((SECONDS - T0)) s"; grep -E "^\||rror" $OUT/serve-long.log | cut -c1-200 | tail -6
timeout $((450 - (SECONDS - T0))) python3 -m benchmarks.serve_bench --model=qwen3-30b-a3b --layers=12 --clients=1,8 \
  --requests=1 --prompt=128 --new_tokens=64 --expert_cache_slots=25% --pcie_frac=auto \
  --json=$OUT/serve-auto.json > $OUT/serve-auto.log 2>&1
echo "serve auto rc=$? at $((SECONDS - T0)) s"; grep -E "^\||rror|pcie_frac" $OUT/serve-auto.log | cut -c1-200 | tail -6
cd $OUT && tar czf call3.tgz *.log *.json 2>/dev/null; ls $OUT
