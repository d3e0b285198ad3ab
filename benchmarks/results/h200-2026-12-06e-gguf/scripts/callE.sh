# Call E (last device minutes): issue 38's server under concurrent openai clients, all resident, 12 layers.
set -u; export PYTHONPATH=. PYTHONUNBUFFERED=1
python3 -c "import fastapi, uvicorn, sse_starlette, openai" 2>&1 | tail -1; [ ${PIPESTATUS[0]} -eq 0 ] || exit 0
timeout 200 python3 -m benchmarks.serve_bench --model=qwen3-30b-a3b --layers=12 --clients=1,2,4,8 --requests=2 \
  --prompt=64 --new_tokens=64 --expert_cache_slots=all --json=$OUT/serve.json > $OUT/serve.log 2>&1
echo "serve rc=$?"; grep -E "^\||error|Error" $OUT/serve.log | cut -c1-220 | tail -12
