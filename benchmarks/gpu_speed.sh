#!/bin/bash
# One GPU call for the speed issue: the peer (llama.cpp) builds on half the cores while our window graphs are timed on
# the other half, then the peer and our generate loop run on the same shape, one table. Everything lands in
# $OUT/speed.tar.gz; the tables are printed last.
#   STEPS="decode profile peer" bash benchmarks/gpu_speed.sh
# Knobs: DECODE_ARMS (name:flags[@XLA_FLAGS];...), DECODE_WINDOWS, PEER_LAYERS, PEER_OURS, PEER_NCMOE, PROFILE_LAYERS.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-out}; R=$OUT/speed; mkdir -p "$R"
STEPS=${STEPS:-"decode profile peer"}
CORES=$(nproc); HALF=$((CORES / 2))
OURS="taskset -c 0-$((HALF - 1))"
command -v taskset >/dev/null || OURS=""
LLAMA=/tmp/llama.cpp
if [ -f .peer/llama.tar.xz ] && [ ! -x $LLAMA/build/bin/llama-bench ] && [[ " $STEPS " == *" peer "* ]]; then
  echo "[peer] building llama-bench on cores $HALF-$((CORES - 1)) (setsid; log $LLAMA.log)"
  BUILD_JOBS=$HALF setsid nohup ${OURS:+taskset -c $HALF-$((CORES - 1))} nice -n 10 \
    bash benchmarks/peer/build_llama.sh "$PWD/.peer/llama.tar.xz" $LLAMA > /dev/null 2>&1 < /dev/null &
fi
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
step() { local name=$1 limit=$2; shift 2; echo "[$name] $*"; local t0=$SECONDS
  timeout "$limit" "$@" > "$R/$name.log" 2>&1; local rc=$?
  echo "[$name] rc=$rc in $((SECONDS - t0)) s"; grep -E '^\|' "$R/$name.log" | tail -12; grep -E "bandwidth|error" "$R/$name.log" | head -3; }
DECODE_WINDOWS=${DECODE_WINDOWS:-1,2,4,8}
DECODE_ARMS=${DECODE_ARMS:-"scan_xla:;scan_pallas:--expert_kernel=pallas --attention_kernel=pallas;unrolled_xla:--layer_loop=unrolled --windows=1"}
if [[ " $STEPS " == *" decode "* ]]; then
  IFS=';' read -ra arms <<< "$DECODE_ARMS"
  for arm in "${arms[@]}"; do
    name=${arm%%:*}; args=${arm#*:}; xla=""
    if [[ "$args" == *@* ]]; then xla=${args#*@}; args=${args%%@*}; fi
    step "decode_$name" 200 env XLA_FLAGS="$xla" $OURS python3 -m benchmarks.decode_bench --model=qwen3-30b-a3b --windows=$DECODE_WINDOWS \
      --hf=off --iters=20 --probe_windows=2 --json=$R/decode_$name.json $args
  done
fi
if [[ " $STEPS " == *" profile "* ]]; then
  step profile 150 env XLA_FLAGS="${PROFILE_XLA:-}" $OURS python3 -m benchmarks.profile_window --model=qwen3-30b-a3b --layers=${PROFILE_LAYERS:-12} \
    --windows=1,4 --iters=10 --expert_kernel=pallas --attention_kernel=pallas --json=$R/profile.json
fi
if [[ " $STEPS " == *" peer "* ]]; then
  t0=$SECONDS; while [ -f .peer/llama.tar.xz ] && [ ! -f $LLAMA.done ] && [ $((SECONDS - t0)) -lt ${BUILD_WAIT_S:-200} ]; do sleep 5; done
  echo "[peer] build: $(cat $LLAMA.done 2>/dev/null || echo 'not done') after waiting $((SECONDS - t0)) s"; tail -3 $LLAMA.log 2>/dev/null
  step peer 420 python3 -m benchmarks.peer_bench --layers=${PEER_LAYERS:-24} --llama_bench=$LLAMA/build/bin/llama-bench \
    --gguf_py=$LLAMA/gguf-py --ours="${PEER_OURS:-default;spec=0}" --ncmoe="${PEER_NCMOE:-}" --json=$R/peer.json
fi
if [[ " $STEPS " == *" peer "* ]] && [ -n "${PEER_XLA:-}" ]; then  # our arms again under other XLA flags
  step peer_xla 300 env XLA_FLAGS="$PEER_XLA" python3 -m benchmarks.peer_bench --layers=${PEER_LAYERS:-24} --llama_bench= \
    --ours="${PEER_OURS:-default;spec=0}" --json=$R/peer_xla.json
fi
tar czf "$OUT/speed.tar.gz" -C "$OUT" speed && rm -rf "$R"
