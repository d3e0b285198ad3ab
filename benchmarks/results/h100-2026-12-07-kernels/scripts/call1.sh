# Call 1: the pool's quantized loops on this host (issue 33); the decode kernels' knobs at the Qwen3-30B-A3B shape
# (kernel-sweep, settings compiled 16 at a time, beside XLA's own product: unstacked, and stacked with and without
# XLA's dynamic-slice fusion), then the 24-layer generate loop's T=1 window (greedy, spec=0) with the kernels'
# defaults and with the sweep's picks, each its own process, then (time left) the picks' window profile.
# SHORT=1 (little device time left): a shorter sweep, one A/B pair, no profile. Everything under $OUT/c1/, tarred
# (run returns 8 files at most).
set -u; export PYTHONPATH=. PYTHONUNBUFFERED=1; T0=$SECONDS; D=$OUT/c1; mkdir -p $D
pack() { tar czf $OUT/c1.tgz -C $OUT c1; }  # after each step: a call cut by its limit still brings back what it did
if [ "${SHORT:-0}" = 1 ]; then POOL_S=60 SWEEP_S=200 CONFIGS=32 BUDGET=110 ARMS="default tuned" END=480
else POOL_S=60 SWEEP_S=250 CONFIGS=32 BUDGET=140 ARMS="default tuned" END=585; fi
left() { echo $(( ${1} - (SECONDS - T0) )); }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; lscpu | grep "Model name"
# the pool's quantized loops (issue 33) on this host's cores, alone, before anything else runs: the new loops, the
# former ones and the float path, beside the 16-thread read bandwidth
timeout $POOL_S python3 -m strata_jax.host_pool.measure --threads 16 --formats bf16,int8,int4,int4-q4k --paths C \
  --windows 1 --variants "default FORMER_LOOPS INT_FLOAT_PATH" > $D/pool.log 2>&1
echo "pool rc=$? at $((SECONDS - T0)) s"; grep -E "^(bf16|int)|read" $D/pool.log | cut -c1-120 | head -30; pack
timeout $SWEEP_S python3 -m benchmarks.kernel_sweep --cases=qkv,o,expert_ffn --configs=$CONFIGS --budget_s=$BUDGET \
  --json=$D/sweep.json > $D/sweep.log 2>&1
echo "sweep rc=$? at $((SECONDS - T0)) s"; cp $D/sweep.json /tmp/strata-sweep.json 2>/dev/null; grep -E "^\|" $D/sweep.log | cut -c1-230; pack
# the engine's XLA path for the attention products (dense_kernel=xla: the layer sliced out of the stacks, then XLA's
# product) with XLA's dynamic-slice fusion on, which may read the slice in place: its "XLA, stacked" column against
# the main sweep's (the default settings only)
XLA_FLAGS=--xla_gpu_enable_dynamic_slice_fusion=true timeout 90 python3 -m benchmarks.kernel_sweep --cases=qkv,o \
  --configs=1 --finalists=1 --json=$D/sweep-dsf.json > $D/sweep-dsf.log 2>&1
echo "sweep dsf rc=$? at $((SECONDS - T0)) s"; grep -E "^\|" $D/sweep-dsf.log | cut -c1-200; pack
for arm in $ARMS; do
  [ $(left $END) -lt 70 ] && break
  env=""; [ $arm = tuned ] && env="STRATA_KERNEL_TUNING=$D/sweep.json"
  env $env timeout $(( $(left $END) < 110 ? $(left $END) : 110 )) python3 -m benchmarks.peer_bench --layers=24 \
    --llama_bench= --reps=3 --ours="spec=0" --warmup_arm=false --json=$D/p24-$arm-$SECONDS.json \
    > $D/p24-$arm-$SECONDS.log 2>&1
  echo "$arm rc=$? at $((SECONDS - T0)) s"; grep -hE "kernel tuning|tok/s" $D/p24-$arm-*.log | tail -2 | cut -c1-200; pack
done
if [ "${SHORT:-0}" != 1 ] && [ $(left 570) -gt 60 ]; then
  STRATA_KERNEL_TUNING=$D/sweep.json timeout $(left 575) python3 -m benchmarks.profile_window \
    --model=qwen3-30b-a3b --layers=24 --windows=1 --json=$D/profile-tuned.json > $D/profile-tuned.log 2>&1
  echo "profile rc=$? at $((SECONDS - T0)) s"; pack
fi
tar czf $OUT/c1.tgz -C $OUT c1; echo "done at $((SECONDS - T0)) s"
