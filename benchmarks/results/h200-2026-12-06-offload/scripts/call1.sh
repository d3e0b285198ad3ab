# Call 1 (no peer build, idle cores): the pool's formats (issue 33), then offload_bench on 12 layers of the 30B shape,
# routing spread: S=E / 50% / 25% x pcie_frac 1, auto, 0 (lru) in one process; pcie_frac 0 with static slots; int4.
set -u; export PYTHONPATH=. PYTHONUNBUFFERED=1; R=$OUT; T0=$SECONDS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; free -g | head -2; lscpu | grep -E "Model name|^CPU\(s\)|Thread|Core"
timeout 140 python3 -m strata_jax.host_pool.measure --threads 16 --formats bf16,int8,int4 --windows 1,4 --paths C > $R/pool.log 2>&1
echo "pool rc=$? at $((SECONDS - T0)) s"; grep -vE "^\s*$" $R/pool.log | tail -24
timeout 260 python3 -m benchmarks.offload_bench --model=qwen3-30b-a3b --layers=12 --slot_fracs=1.0,0.5,0.25 \
  --pcie_fracs=1,auto,0 --embed_scale=50 --new_tokens=64 --json=$R/offload.json > $R/offload.log 2>&1
echo "offload rc=$? at $((SECONDS - T0)) s"; grep -E "^\||pcie_frac: |rror" $R/offload.log | cut -c1-240 | tail -30
timeout $((570 - (SECONDS - T0))) python3 -m benchmarks.offload_bench --model=qwen3-30b-a3b --layers=12 --slot_fracs=0.5,0.25 \
  --pcie_fracs=0,1 --cache_policy=static --embed_scale=50 --new_tokens=64 --json=$R/offload_static.json > $R/offload_static.log 2>&1
echo "static rc=$? at $((SECONDS - T0)) s"; grep -E "^\||rror" $R/offload_static.log | cut -c1-240 | tail -16
