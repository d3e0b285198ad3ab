# Call 4 (same warm H100 machine as calls 2-3): the plan without sorts or scatters (after, 795c1c9) against the plan
# before it (slots_before.py.gz = 795c1c9~1's strata_jax/offload/slots.py; the call ran it uncompressed), alternated after / before / after, each a
# process of offload_bench on 12 layers, S=E and 50% PCIe only; then int4 experts at 25%.
export PYTHONPATH=. PYTHONUNBUFFERED=1; S=benchmarks/results/h200-2026-12-06-offload/scripts
A="--model=qwen3-30b-a3b --layers=12 --slot_fracs=1.0,0.5 --pcie_fracs=1 --embed_scale=50 --new_tokens=64"
for v in after before after2; do
  [ $v = before ] && { cp strata_jax/offload/slots.py /tmp/after.py; gunzip -c $S/slots_before.py.gz > strata_jax/offload/slots.py; }
  [ $v = after2 ] && cp /tmp/after.py strata_jax/offload/slots.py
  timeout 80 python3 -m benchmarks.offload_bench $A --json=$OUT/ab_$v.json > $OUT/ab_$v.log 2>&1; echo "$v rc=$?"
  grep -E "^\| (all|S=)" $OUT/ab_$v.log | cut -c1-200
done
timeout 90 python3 -m benchmarks.offload_bench --model=qwen3-30b-a3b --layers=12 --slot_fracs=0.25 --pcie_fracs=1 \
  --expert_dtype=int4 --embed_scale=50 --new_tokens=64 --json=$OUT/int4.json > $OUT/int4.log 2>&1
echo "int4 rc=$?"; grep -E "^\| (all|S=)" $OUT/int4.log | cut -c1-250
