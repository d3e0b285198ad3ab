# Call A (2026-12-06, second session): the plan kernel's GPU test, the offload GPU tests, then one process each,
# alternated: XLA plan (main), Pallas plan kernel, 795c1c9's body (before the packed leaves), Pallas, XLA;
# offload_bench 12 layers S=E and 50% PCIe only. Then pcie_frac 0 / auto / 1 at 50% and 25% if time is left.
set -u; export PYTHONPATH=. PYTHONUNBUFFERED=1 TESTS_COMPILE_GRAPHS=lazy; T0=$SECONDS
S=benchmarks/results/h200-2026-12-06-offload/scripts
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; lscpu | grep -E "Model name"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/offload/test_slot_plan.py -k "kernel" > $OUT/plan_tests.log 2>&1
echo "plan kernel tests rc=$? at $((SECONDS-T0)) s"; tail -2 $OUT/plan_tests.log
timeout 200 python3 -m pytest -v -p no:cacheprovider -o console_output_style=classic \
  -k "offload_is_exact or blocks_of_experts" tests/engine/test_gpu.py > $OUT/tests.log 2>&1
echo "tests rc=$? at $((SECONDS-T0)) s"; grep -E "PASS|FAIL|ERROR|passed|failed" $OUT/tests.log | cut -c1-150 | tail -9
A="--model=qwen3-30b-a3b --layers=12 --slot_fracs=1.0,0.5 --pcie_fracs=1 --embed_scale=50 --new_tokens=64"
cp strata_jax/offload/slots.py /tmp/slots_after.py; cp strata_jax/model/transformer.py /tmp/transformer_after.py
for v in xla pallas before pallas2 xla2; do
  [ $((SECONDS-T0)) -gt 480 ] && { echo "skip $v: time"; continue; }
  if [ $v = before ]; then gunzip -c $S/slots_795c1c9.py.gz > strata_jax/offload/slots.py; gunzip -c $S/transformer_795c1c9.py.gz > strata_jax/model/transformer.py; K=xla
  else cp /tmp/slots_after.py strata_jax/offload/slots.py; cp /tmp/transformer_after.py strata_jax/model/transformer.py; K=${v%2}; fi
  timeout 80 python3 -m benchmarks.offload_bench $A --plan_kernel=$K --json=$OUT/ab_$v.json > $OUT/ab_$v.log 2>&1
  echo "$v rc=$? at $((SECONDS-T0)) s"; grep -E "^\| (all|S=)" $OUT/ab_$v.log | cut -c1-200
  grep -E "^  S=" $OUT/ab_$v.log
done
cp /tmp/slots_after.py strata_jax/offload/slots.py; cp /tmp/transformer_after.py strata_jax/model/transformer.py
L=$((590 - (SECONDS-T0))); [ $L -gt 60 ] && { timeout $L python3 -m benchmarks.offload_bench --model=qwen3-30b-a3b --layers=12 \
  --slot_fracs=0.5,0.25 --pcie_fracs=0,auto,1 --embed_scale=50 --new_tokens=64 --json=$OUT/split.json > $OUT/split.log 2>&1
  echo "split rc=$? at $((SECONDS-T0)) s"; grep -E "^\| (all|S=)|pcie_frac: " $OUT/split.log | cut -c1-220; }
