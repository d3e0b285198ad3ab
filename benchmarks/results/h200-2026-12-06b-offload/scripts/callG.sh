# Call G: the plan kernel with more warps (plan_warps: 16 at S=128; STRATA_PLAN_WARPS=32) against the XLA plan,
# offload_bench 12 layers, S=E PCIe only (the fixed cost a layer), one process each, alternated.
set -u; export PYTHONPATH=. PYTHONUNBUFFERED=1; T0=$SECONDS
for v in xla pallas16 pallas32 xla2 pallas16b; do
  K=xla; W=""; case $v in pallas16*) K=pallas;; pallas32) K=pallas; W=32;; esac
  STRATA_PLAN_WARPS=$W timeout 70 python3 -m benchmarks.offload_bench --model=qwen3-30b-a3b --layers=12 --slot_fracs=1.0 \
    --pcie_fracs=1 --embed_scale=50 --new_tokens=64 --plan_kernel=$K > $OUT/g_$v.log 2>&1
  echo "$v rc=$? at $((SECONDS-T0)) s: $(grep -E '^\| (all|S=)' $OUT/g_$v.log | awk -F'|' '{print $2 $5}' | tr '\n' ' ')"
done
