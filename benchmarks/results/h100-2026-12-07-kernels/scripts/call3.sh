# Call 3 (chained on call 2's warm machine): (a) the 24-layer window graph with the attention products by the
# kernel's defaults, its picks (TUNING as call 2's: /tmp/strata-sweep.json where call 1 left it) and XLA with its
# dynamic-slice fusion; issue 38's batched windows with the sweep's wide picks: (b) batch_bench in process, 12
# layers, B = 1 / 8, defaults then picks; (c) the server with the picks, 1 / 8 clients of one request each.
# Carry .peer/wheels/serve (the machine has no fastapi).
set -u; export PYTHONUNBUFFERED=1; T0=$SECONDS; D=$OUT/c3; mkdir -p $D; TUNING=${TUNING:-/tmp/strata-sweep.json}
pack() { tar czf $OUT/c3.tgz -C $OUT c3; }  # after each step: a call cut by its limit still brings back what it did
case $TUNING in /*) ;; *) TUNING=$PWD/$TUNING;; esac
nvidia-smi --query-gpu=name --format=csv,noheader; echo "tuning: $TUNING $( [ -f $TUNING ] && echo present || echo MISSING)"
python3 -m pip install -q --no-index --find-links .peer/wheels/serve --target /tmp/serve-site fastapi uvicorn \
  sse-starlette openai > /tmp/pip.log 2>&1; echo "pip rc=$? at $((SECONDS - T0)) s"
export PYTHONPATH=.:/tmp/serve-site
# the 24-layer window graph alone (T=1 and 8, synced and back to back): the attention products by the Pallas kernel
# with its defaults, with the picks, and by XLA with its dynamic-slice fusion (the stacks' layer read in place?)
for arm in pallas tuned xla-dsf; do
  env=""; flag=""; [ $arm = tuned ] && env="STRATA_KERNEL_TUNING=$TUNING"
  [ $arm = xla-dsf ] && env="XLA_FLAGS=--xla_gpu_enable_dynamic_slice_fusion=true" && flag="--dense_kernel=xla"
  env $env timeout 75 python3 -m benchmarks.decode_bench --model=qwen3-30b-a3b --layers=24 --windows=1,8 --hf=off \
    --iters=20 $flag --json=$D/window-$arm.json > $D/window-$arm.log 2>&1
  echo "window $arm rc=$? at $((SECONDS - T0)) s"; grep -E "^\||rror|kernel tuning" $D/window-$arm.log | cut -c1-200 | tail -4; pack
done
for arm in default tuned; do
  env=""; [ $arm = tuned ] && env="STRATA_KERNEL_TUNING=$TUNING"
  env $env timeout 100 python3 -m benchmarks.batch_bench --model=qwen3-30b-a3b --layers=12 --batch=1,8 --prompt=128 \
    --new_tokens=128 --json=$D/batch-$arm.json > $D/batch-$arm.log 2>&1
  echo "batch $arm rc=$? at $((SECONDS - T0)) s"; grep -E "^\||rror|kernel tuning" $D/batch-$arm.log | cut -c1-200 | tail -5; pack
done
STRATA_KERNEL_TUNING=$TUNING timeout $((580 - (SECONDS - T0))) python3 -m benchmarks.serve_bench --model=qwen3-30b-a3b \
  --layers=12 --clients=1,8 --requests=1 --prompt=128 --new_tokens=256 --expert_cache_slots=all \
  --json=$D/serve-tuned.json > $D/serve-tuned.log 2>&1
echo "serve rc=$? at $((SECONDS - T0)) s"; grep -E "^\||rror|kernel tuning" $D/serve-tuned.log | cut -c1-200 | tail -6; pack
tar czf $OUT/c3.tgz -C $OUT c3; echo "done at $((SECONDS - T0)) s"
