# Call 4: pcie_frac=auto re-chosen after each request (the engine's own arm first: built with auto), beside
# pcie_frac=1, at half the experts in slots; then the scanned offload window with XLA's while loop inside the
# command buffer (the device fetch left no memory operation in a graph without the pool).
set -u; export PYTHONPATH=. PYTHONUNBUFFERED=1
D=benchmarks/results/h200-2026-12-04b-scanned-offload/scripts
R=$OUT/call4; mkdir -p $R
timeout 150 python3 -m benchmarks.offload_bench --model=qwen3-30b-a3b --layers=12 --slot_fracs=0.5 \
  --pcie_fracs=auto,1 --embed_scale=50 --new_tokens=64 --json=$R/offload.json > $R/offload.log 2>&1
echo "offload rc=$?"; grep -E "^\|" $R/offload.log | head -6; grep -E "pcie_frac .* at start-up|pcie_frac:" $R/offload.log | head -4
timeout 80 env XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL" \
  python3 $D/dispatch.py offloadE-scan-cbwhile:128:scan > $R/dispatch_cbwhile.log 2>&1
echo "cbwhile rc=$?"; grep -v "^---\|^\[\|^W1204" $R/dispatch_cbwhile.log | tail -3
