# Call 1 (2026-12-06, sixth session): issue 38's server under 1..16 concurrent openai clients (serve_bench), all
# resident (2 requests a client, 128 + 128 tokens) and with 25% of the experts in slots (1 request, 128 + 64), the
# 30B shape cut to 12 layers, random weights with spread routing; nothing else on the host meanwhile.
set -u; export PYTHONUNBUFFERED=1; T0=$SECONDS; L=/tmp/llama.cpp; G=/dev/shm/qwen3-30b-a3b-12.gguf
WHEEL=$PWD/.peer/wheels/gguf-0.19.0-py3-none-any.whl
nvidia-smi --query-gpu=name --format=csv,noheader; lscpu | grep -E "Model name|^CPU\(s\)|Thread\(s\) per core"
git log --oneline -1 | cut -c1-80
python3 -m pip install -q --no-index --find-links .peer/wheels/serve --target /tmp/serve-site fastapi uvicorn \
  sse-starlette openai > /tmp/pip.log 2>&1; echo "pip rc=$? at $((SECONDS - T0)) s"
export PYTHONPATH=.:/tmp/serve-site
python3 -c "import fastapi, uvicorn, sse_starlette, openai" || tail -3 /tmp/pip.log
timeout 250 python3 -m benchmarks.serve_bench --model=qwen3-30b-a3b --layers=12 --clients=1,2,4,8,16 --requests=2 \
  --prompt=128 --new_tokens=128 --expert_cache_slots=all --json=$OUT/serve-all.json > $OUT/serve-all.log 2>&1
echo "serve all rc=$? at $((SECONDS - T0)) s"; grep -E "^\||rror" $OUT/serve-all.log | cut -c1-200 | tail -10
timeout $((545 - (SECONDS - T0))) python3 -m benchmarks.serve_bench --model=qwen3-30b-a3b --layers=12 \
  --clients=1,2,4,8,16 --requests=1 --prompt=128 --new_tokens=64 --expert_cache_slots=25% --pcie_frac=1 \
  --json=$OUT/serve-25.json > $OUT/serve-25.log 2>&1
echo "serve 25% rc=$? at $((SECONDS - T0)) s"; grep -E "^\||rror" $OUT/serve-25.log | cut -c1-200 | tail -10
