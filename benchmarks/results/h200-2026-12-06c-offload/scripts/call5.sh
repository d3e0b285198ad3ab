# Call 5 (2026-12-06, third session): the host pool alone (pcie_frac 0) in the generate loop at 50% / 25% of the
# slots, one process each, alternated: the kept team's idle spin 200 us (default) against 1000 us
# (STRATA_POOL_SPIN_US; call 4's measure.py with gaps of 100 / 300 us between jobs: 1000 keeps the workers awake) and
# 15 threads (a core left to XLA's dispatch and the offload worker); then int4-q4k against int4 experts at 25%
# (issue 36's figure; PCIe only and auto).
set -u; export PYTHONPATH=. PYTHONUNBUFFERED=1; T0=$SECONDS
nvidia-smi --query-gpu=name --format=csv,noheader
B="python3 -m benchmarks.offload_bench --model=qwen3-30b-a3b --layers=12 --slot_fracs=0.5,0.25 --pcie_fracs=0 --embed_scale=50 --new_tokens=64"
for v in spin200 spin1000 t15 spin1000b spin200b; do
  case $v in spin200*) E="STRATA_POOL_SPIN_US=200"; X="";; spin1000*) E="STRATA_POOL_SPIN_US=1000"; X="";; t15) E="STRATA_POOL_SPIN_US=200"; X="--cpu_threads=15";; esac
  env $E timeout 80 $B $X > $OUT/pool_$v.log 2>&1
  echo "$v rc=$? at $((SECONDS-T0)) s: $(grep -E '^\| (all|S=)' $OUT/pool_$v.log | awk -F'|' '{print $2 $5}' | tr '\n' ' ')"
done
for ed in int4 int4-q4k; do timeout 90 python3 -m benchmarks.offload_bench --model=qwen3-30b-a3b --layers=12 \
  --dtype=bfloat16 --expert_dtype=$ed --slot_fracs=0.25 --pcie_fracs=1,auto --embed_scale=50 --new_tokens=64 \
  > $OUT/offload_$ed.log 2>&1
  echo "$ed rc=$? at $((SECONDS - T0)) s: $(grep -E '^\| (all|S=)' $OUT/offload_$ed.log | awk -F'|' '{print $2 $5 $6}' | tr '\n' ' ')"
  [ $((SECONDS - T0)) -gt 500 ] && break; done
cd $OUT && tar czf call5.tgz *.log 2>/dev/null && rm -f *.log
