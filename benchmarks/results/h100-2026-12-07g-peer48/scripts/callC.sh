# Call C (issue 38's figures on this machine, then issue 34's fixed cost): the server with 1..16 openai clients all
# resident and 1 / 8 clients with 25% of the experts in slots (the ninth session measured all resident on an H100
# only: 3.25x at 8 clients); batch_bench in process, B = 1 / 8; then offload_bench S=E / 50% / 25% PCIe only beside
# all resident (the fixed cost a layer) and the S=E layer body's optimized HLO. Carry [".peer/wheels"].
set -u; export PYTHONUNBUFFERED=1; T0=$SECONDS; D=$OUT/cC; mkdir -p $D
pack() { tar czf $OUT/cC.tgz -C $OUT cC; }
nvidia-smi --query-gpu=name --format=csv,noheader; lscpu | grep -E "Model name|^CPU\(s\)"; git log --oneline -1 | cut -c1-80
python3 -m pip install -q --no-index --find-links .peer/wheels/serve --target /tmp/serve-site fastapi uvicorn \
  sse-starlette openai > /tmp/pip.log 2>&1; echo "pip rc=$? at $((SECONDS - T0)) s"
export PYTHONPATH=.:/tmp/serve-site
S="python3 -m benchmarks.serve_bench --model=qwen3-30b-a3b --layers=12 --prompt=128 --new_tokens=256"
timeout 150 $S --clients=1,2,4,8,16 --requests=2 --expert_cache_slots=all --json=$D/serve-all.json > $D/serve-all.log 2>&1
echo "serve all rc=$? at $((SECONDS - T0)) s"; grep -E "^\||rror" $D/serve-all.log | cut -c1-200; pack
timeout 120 python3 -m benchmarks.batch_bench --model=qwen3-30b-a3b --layers=12 --batch=1,8 --prompt=128 \
  --new_tokens=128 --json=$D/batch-all.json > $D/batch-all.log 2>&1
echo "batch rc=$? at $((SECONDS - T0)) s"; grep -E "^\||rror" $D/batch-all.log | cut -c1-200 | tail -5; pack
timeout 150 python3 -m benchmarks.offload_bench --model=qwen3-30b-a3b --layers=12 --slot_fracs=1.0,0.5,0.25 \
  --pcie_fracs=1 --embed_scale=50 --new_tokens=64 --json=$D/offload.json > $D/offload.log 2>&1
echo "offload rc=$? at $((SECONDS - T0)) s"; grep -E "^\| (all|S=)|rror|fixed|over all" $D/offload.log | cut -c1-250; pack
[ $((SECONDS - T0)) -lt 420 ] && timeout $((560 - (SECONDS - T0))) $S --clients=1,8 --requests=1 \
  --expert_cache_slots=25% --pcie_frac=auto --json=$D/serve-25.json > $D/serve-25.log 2>&1
echo "serve 25% rc=$? at $((SECONDS - T0)) s"; grep -E "^\||rror" $D/serve-25.log | cut -c1-200; pack
[ $((SECONDS - T0)) -lt 500 ] && timeout $((580 - (SECONDS - T0))) python3 \
  benchmarks/results/h200-2026-12-07f-auto/scripts/body_hlo.py $D > $D/body_hlo.log 2>&1
grep -vE "^W1|cuda_timer" $D/body_hlo.log | head -50; pack; echo "done at $((SECONDS - T0)) s"
