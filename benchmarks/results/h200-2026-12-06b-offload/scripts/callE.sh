# Call E: prefetch (8de76ff, engine option prefetch=N) on a GPU: its exactness tests (the CUDA handler's first run),
# then offload_bench 12 layers at 50% / 25% PCIe only with prefetch 0 / 4 / 8 / 0, one process each.
set -u; export PYTHONPATH=. PYTHONUNBUFFERED=1 TESTS_COMPILE_GRAPHS=lazy; T0=$SECONDS
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 170 python3 -m pytest -q -p no:cacheprovider -o console_output_style=classic tests/offload/test_prefetch.py > $OUT/prefetch_tests.log 2>&1
echo "prefetch tests rc=$? at $((SECONDS-T0)) s"; tail -3 $OUT/prefetch_tests.log | cut -c1-200
for pf in 0 4 8 0b; do
  [ $((SECONDS-T0)) -gt 500 ] && { echo "skip $pf: time"; continue; }
  timeout 95 python3 -m benchmarks.offload_bench --model=qwen3-30b-a3b --layers=12 --slot_fracs=0.5,0.25 --pcie_fracs=1 \
    --embed_scale=50 --new_tokens=64 --prefetch=${pf%b} --json=$OUT/pf$pf.json > $OUT/pf$pf.log 2>&1
  echo "prefetch $pf rc=$? at $((SECONDS-T0)) s"; grep -E "^\| (all|S=)|^\| arm|moved|prefetch" $OUT/pf$pf.log | cut -c1-260 | head -8
done
cd $OUT && tar czf callE.tgz *.log *.json 2>/dev/null && rm -f *.json
