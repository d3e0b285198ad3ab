# Call B (issues 33 / 34), on call A's warm machine: our generate loop beside llama.cpp in one run. llama-bench
# -ncmoe 6 / 9 (50% / 25% of the expert bytes on the GPU) and all on the GPU, beside ours at 64 / 32 slots: the host
# pool alone (pcie_frac=0), the same with slot_refresh=32 (the slots re-take the request's most used experts every 32
# windows), PCIe only (1), the default split (auto), and fixed splits 0.75 / 0.5 (does a split beat PCIe only where auto picks 1?), and all defaults (drafts on, greedy) at both; no drafts, temperature 1, spread routing, 128 tokens, 2 reps.
# Then, if time remains, the pool-alone arm with the worker's ring beside the tokens' read times.
set -u; export PYTHONPATH=. PYTHONUNBUFFERED=1; L=/tmp/llama.cpp; T0=$SECONDS; D=$OUT/cB; mkdir -p $D
G=/dev/shm/qwen3-30b-a3b-12.gguf; WHEEL=$PWD/.peer/wheels/gguf-0.19.0-py3-none-any.whl
nvidia-smi --query-gpu=name --format=csv,noheader; git log --oneline -1 | cut -c1-80; ls -la $L/build/bin/llama-bench $G | cut -c1-150
T1="spec=0,temperature=1"
timeout 470 python3 -m benchmarks.peer_bench --layers=12 --gguf=$G --llama_bench=$L/build/bin/llama-bench \
  --gguf_py=$WHEEL --ncmoe=6,9 --embed_scale=50 --reps=2 --json=$D/peer12.json \
  --ours="expert_cache_slots=64,pcie_frac=0,$T1;expert_cache_slots=32,pcie_frac=0,$T1;expert_cache_slots=64,pcie_frac=0,slot_refresh=32,$T1;expert_cache_slots=32,pcie_frac=0,slot_refresh=32,$T1;expert_cache_slots=64,pcie_frac=1,$T1;expert_cache_slots=32,pcie_frac=1,$T1;expert_cache_slots=64,$T1;expert_cache_slots=32,$T1;expert_cache_slots=64,pcie_frac=0.75,$T1;expert_cache_slots=64,pcie_frac=0.5,$T1;expert_cache_slots=32,pcie_frac=0.5,$T1;expert_cache_slots=64;expert_cache_slots=32" \
  > $D/peer12.log 2>&1
echo "peer12 rc=$? at $((SECONDS - T0)) s"; grep -E "^\||rror|peer: -ngl" $D/peer12.log | cut -c1-230 | tail -24
tar czf $OUT/cB.tgz -C $OUT cB
if [ $((SECONDS - T0)) -lt 500 ]; then
  STRATA_OFFLOAD_TIMELINE=100000 timeout $((585 - (SECONDS - T0))) python3 -m benchmarks.offload_bench --model=qwen3-30b-a3b \
    --layers=12 --embed_scale=50 --new_tokens=64 --slot_fracs=0.5 --pcie_fracs=0 --json=$D/pool-ring.json > $D/pool-ring.log 2>&1
  echo "pool ring rc=$? at $((SECONDS - T0)) s"; grep -E "offload worker|decode jobs|tok/s \(|slots filled" $D/pool-ring.log | cut -c1-260
  tar czf $OUT/cB.tgz -C $OUT cB
fi
