# Prepared for the next session (not run: the GPU machine has no fastapi; call E stopped there). Carry
# .peer/wheels/serve. Issue 38's server under 1..16 concurrent openai clients, all resident and 25% of the experts.
set -u; export PYTHONUNBUFFERED=1; T0=$SECONDS
python3 -m pip install -q --no-index --find-links .peer/wheels/serve --target /tmp/serve-site fastapi uvicorn \
  sse-starlette openai > /tmp/pip.log 2>&1; echo "pip rc=$?"; export PYTHONPATH=.:/tmp/serve-site
python3 -c "import fastapi, uvicorn, sse_starlette, openai" || exit 0
timeout $((560 - (SECONDS - T0))) python3 -m benchmarks.serve_bench --model=qwen3-30b-a3b --layers=12 \
  --clients=1,2,4,8,16 --requests=2 --prompt=128 --new_tokens=128 --expert_cache_slots=all,25% --pcie_frac=1 \
  --json=$OUT/serve.json > $OUT/serve.log 2>&1
echo "serve rc=$? at $((SECONDS - T0)) s"; grep -E "^\||error|Error" $OUT/serve.log | cut -c1-220 | tail -16
