# Call E (issue 34's fixed cost a MoE layer, target 0.03 ms): S=E through the offload path (PCIe only) against all
# resident, 12 layers by offload_bench twice (each its own process), then 48 layers by peer_bench (offload_bench
# refuses 48 layers: two host copies of 58 GB), with the GPU's memory fraction raised for the all-resident engine.
set -u; export PYTHONPATH=. PYTHONUNBUFFERED=1; T0=$SECONDS; D=$OUT/cE; mkdir -p $D
nvidia-smi --query-gpu=name --format=csv,noheader; git log --oneline -1 | cut -c1-80
for i in 1 2; do
  timeout 120 python3 -m benchmarks.offload_bench --model=qwen3-30b-a3b --layers=12 --slot_fracs=1.0 --pcie_fracs=1 \
    --embed_scale=50 --new_tokens=64 --json=$D/offload12-$i.json > $D/offload12-$i.log 2>&1
  echo "offload12 $i rc=$? at $((SECONDS - T0)) s"; grep -E "^\| (all|S=)|S=128 pcie=1: \+" $D/offload12-$i.log | cut -c1-200
done
T1="spec=0,temperature=1"
XLA_PYTHON_CLIENT_MEM_FRACTION=0.97 timeout 200 python3 -m benchmarks.peer_bench --layers=48 --llama_bench= \
  --embed_scale=50 --reps=2 --nowarmup_arm --json=$D/ours48.json \
  --ours="expert_cache_slots=all,$T1;expert_cache_slots=128,pcie_frac=1,$T1" > $D/ours48.log 2>&1
echo "ours48 rc=$? at $((SECONDS - T0)) s"; grep -E "ours \[.*tok/s" $D/ours48.log | cut -c1-250
tar czf $OUT/cE.tgz -C $OUT cE; echo "done at $((SECONDS - T0)) s"
