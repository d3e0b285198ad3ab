# Prepared for the next session (issue 34's last rows; not run in the fourteenth): (1) the fixed cost a MoE layer
# without cold fetches (fixed_cost.py: both engines warmed until a request fetches nothing, timed in turn), 12 and
# 24 layers; (2) int4 experts at 48 layers, 25% of the slots, PCIe only, beside int4 all resident (offload_bench,
# which also measures device_put); (3) bf16 at 48 layers all resident and 25% PCIe only in one process (peer_bench,
# ours only): the bf16 share of its bound at 48 layers and the int4 ratio's denominator, from one call. No carry.
set -u; export PYTHONPATH=. PYTHONUNBUFFERED=1; T0=$SECONDS; D=$OUT/cN; mkdir -p $D
nvidia-smi --query-gpu=name --format=csv,noheader; git log --oneline -1 | cut -c1-80
S=benchmarks/results/h100-2026-12-07g-peer48/scripts/fixed_cost.py
XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout 150 python3 $S 12 5 > $D/fixed12.log 2>&1
echo "fixed12 rc=$? at $((SECONDS - T0)) s"; grep -vE "^W1|^E1" $D/fixed12.log | tail -4
XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout 170 python3 $S 24 4 > $D/fixed24.log 2>&1
echo "fixed24 rc=$? at $((SECONDS - T0)) s"; grep -vE "^W1|^E1" $D/fixed24.log | tail -4
timeout 160 python3 -m benchmarks.offload_bench --model=qwen3-30b-a3b --layers=48 --slot_fracs=0.25 --pcie_fracs=1 \
  --expert_dtype=int4 --embed_scale=50 --new_tokens=64 --json=$D/offload48_int4.json > $D/offload48_int4.log 2>&1
echo "int4 48 rc=$? at $((SECONDS - T0)) s"; grep -E "^\| (all|S=)|pinned device_put|rror" $D/offload48_int4.log | cut -c1-200
T1="spec=0,temperature=1"
XLA_PYTHON_CLIENT_MEM_FRACTION=0.97 timeout $((590 - (SECONDS - T0))) python3 -m benchmarks.peer_bench --layers=48 \
  --llama_bench= --embed_scale=50 --reps=2 --nowarmup_arm --json=$D/bf16_48.json \
  --ours="expert_cache_slots=all,$T1;expert_cache_slots=32,pcie_frac=1,$T1" > $D/bf16_48.log 2>&1
echo "bf16 48 rc=$? at $((SECONDS - T0)) s"; grep -E "ours \[.*tok/s" $D/bf16_48.log | cut -c1-250
tar czf $OUT/cN.tgz -C $OUT cN; echo "done at $((SECONDS - T0)) s"
