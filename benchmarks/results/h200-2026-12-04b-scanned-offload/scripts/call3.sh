# Call 3: the device fetch kernel. GPU tests (exact, the kernel used, the worker fallback), then dispatch against
# device time with 60 windows queued (the deadlock of call 2 gone?), then offload_bench, scanned graph, bf16.
set -u; export PYTHONPATH=. PYTHONUNBUFFERED=1
D=benchmarks/results/h200-2026-12-04b-scanned-offload/scripts
R=$OUT/call3; mkdir -p $R
timeout 200 python3 -m pytest -q -p no:cacheprovider -x -k "offload or pallas_expert or pinned" tests/test_gpu.py \
  > $R/tests.log 2>&1; echo "tests rc=$?"; tail -3 $R/tests.log
timeout 230 python3 $D/dispatch.py offloadE-scan:128:scan offload32-scan:32:scan resident:all:scan \
  offloadE-unrolled:128:unrolled > $R/dispatch.log 2>&1; echo "dispatch rc=$?"; grep -v "^---\|^\[" $R/dispatch.log | tail -8
timeout 200 python3 -m benchmarks.offload_bench --model=qwen3-30b-a3b --layers=12 --slot_fracs=1.0,0.5,0.25 \
  --pcie_fracs=1,auto --embed_scale=50 --new_tokens=64 --json=$R/offload.json > $R/offload.log 2>&1
echo "offload rc=$?"; grep -E "^\|" $R/offload.log | head -12; grep "fetches by\|error" $R/offload.log | head -3
