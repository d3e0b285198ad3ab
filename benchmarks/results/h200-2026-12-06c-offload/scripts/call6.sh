# Call 6 (2026-12-06, third session): the host pool alone (pcie_frac 0) at 50% / 25% of the slots with 16 / 15 / 14
# threads (call 5: 15 threads ran 211 / 220 tok/s against 16's 205-208 / 187-197), one process each, mirrored.
set -u; export PYTHONPATH=. PYTHONUNBUFFERED=1; T0=$SECONDS
B="python3 -m benchmarks.offload_bench --model=qwen3-30b-a3b --layers=12 --slot_fracs=0.5,0.25 --pcie_fracs=0 --embed_scale=50 --new_tokens=64"
for t in 16 15 14 14 15 16; do
  timeout 60 $B --cpu_threads=$t > $OUT/threads_$t.$SECONDS.log 2>&1
  echo "threads $t rc=$? at $((SECONDS-T0)) s: $(grep -E '^\| (all|S=)' $OUT/threads_$t.*.log | tail -3 | awk -F'|' '{print $2 $5}' | tr '\n' ' ')"
  rm -f $OUT/threads_$t.*.log
  [ $((SECONDS - T0)) -gt 330 ] && break
done
