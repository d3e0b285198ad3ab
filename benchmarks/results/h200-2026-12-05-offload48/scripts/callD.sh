# Call D: where the host time of a decode window goes, by depth: resident and offloaded (S=E, and 32 slots) scanned
# T=1 windows at 6, 12 and 24 layers (dispatch, queued, synced, and a no-op graph of the same arguments); then the
# offloaded 12-layer arm with XLA's while loops in the command buffers.
set -u; export PYTHONPATH=. PYTHONUNBUFFERED=1
D=benchmarks/results/h200-2026-12-05-offload48/scripts; R=$OUT/callD; mkdir -p $R; T0=$SECONDS
timeout 330 python3 $D/dispatch.py res6:all:6 res12:all:12 res24:all:24 off6:128:6 off12:128:12 off24:128:24 \
  off12s32:32:12 > $R/dispatch.log 2>&1; echo "dispatch rc=$? at $((SECONDS - T0)) s"; grep -E "^(res|off)" $R/dispatch.log
timeout 120 env XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL" \
  python3 $D/dispatch.py res12-cbwhile:all:12 off12-cbwhile:128:12 > $R/dispatch_cbwhile.log 2>&1
echo "cbwhile rc=$? at $((SECONDS - T0)) s"; grep -E "^(res|off)" $R/dispatch_cbwhile.log; grep -iE "error" $R/*.log | head -5
