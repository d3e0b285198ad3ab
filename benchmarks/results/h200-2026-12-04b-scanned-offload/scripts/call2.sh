# Call 2: where the scanned offload window's time goes (dispatch against device time), and whether XLA's while
# loop in a command buffer changes it; how often the capture-path handlers run (re-recording per iteration?).
set -u; export PYTHONPATH=. PYTHONUNBUFFERED=1
D=benchmarks/results/h200-2026-12-04b-scanned-offload/scripts
R=$OUT/call2; mkdir -p $R
timeout 240 python3 $D/dispatch.py resident:all:scan offloadE-scan:128:scan offloadE-unrolled:128:unrolled \
  offload32-scan:32:scan offload32-unrolled:32:unrolled > $R/dispatch.log 2>&1; echo "rc=$?"; cat $R/dispatch.log | grep -v "^---"
timeout 150 env XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL" \
  python3 $D/dispatch.py resident-cbwhile:all:scan offloadE-scan-cbwhile:128:scan offload32-scan-cbwhile:32:scan \
  > $R/dispatch_cbwhile.log 2>&1; echo "rc=$?"; grep -v "^---" $R/dispatch_cbwhile.log | grep -v "^\[" | tail -8
timeout 90 env STRATA_OFFLOAD_TRACE=1 python3 $D/dispatch.py offloadE-scan-trace:128:scan > $R/trace.log 2>&1
echo "rc=$?"; tail -1 $R/trace.log
echo "handler runs (begin_v2 recorded or run): $(grep -c 'begin_v2:' $R/trace.log); after the 60-window mark: $(sed -n '/60 windows queued/,$p' $R/trace.log | grep -c 'begin_v2:')"
echo "worker jobs after the mark: $(sed -n '/60 windows queued/,$p' $R/trace.log | grep -c 'worker: layer .* posted')"
gzip -f $R/trace.log
