# Call B (issue 34's 48-layer row), on call A's warm machine: the thirteenth session's callE2.sh with the PCIe-only arms
# added: llama-bench -ncmoe 24 / 36 (50% / 25% of the expert bytes on the GPU) and all on the GPU, the GGUF deleted
# (--drop_gguf), then ours at 64 / 32 slots, default split (pcie_frac=auto) then PCIe only, no drafts, temperature 1,
# spread routing, 128 tokens, 2 reps, no warm-up arm.
set -u; export PYTHONPATH=. PYTHONUNBUFFERED=1; L=/tmp/llama.cpp; T0=$SECONDS; D=$OUT/cB; mkdir -p $D
G=/dev/shm/qwen3-30b-a3b-48.gguf; WHEEL=$PWD/.peer/wheels/gguf-0.19.0-py3-none-any.whl
nvidia-smi --query-gpu=name --format=csv,noheader; lscpu | grep -E "Model name|^CPU\(s\)"
while { [ ! -f $L.done ] || [ ! -f /tmp/gguf48.done ]; } && [ $((SECONDS - T0)) -lt 200 ]; do sleep 5; done
ls -la $L/build/bin/llama-bench $G | cut -c1-150 || exit 3
T1="spec=0,temperature=1"
timeout 580 python3 -m benchmarks.peer_bench --layers=48 --gguf=$G --llama_bench=$L/build/bin/llama-bench \
  --gguf_py=$WHEEL --ncmoe=24,36 --embed_scale=50 --reps=2 --nowarmup_arm --drop_gguf --json=$D/peer48.json \
  --ours="expert_cache_slots=64,$T1;expert_cache_slots=32,$T1;expert_cache_slots=64,pcie_frac=1,$T1;expert_cache_slots=32,pcie_frac=1,$T1" \
  > $D/peer48.log 2>&1
echo "peer48 rc=$? at $((SECONDS - T0)) s"; grep -E "^\||rror|peer: |pcie_frac|deleted" $D/peer48.log | cut -c1-230 | tail -30
tar czf $OUT/cB.tgz -C $OUT cB
