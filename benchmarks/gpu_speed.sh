#!/bin/bash
# GPU calls for the speed issue. Steps run in the order given; everything lands in $OUT/speed.tar.gz, tables printed.
#   STEPS="build tests" bash benchmarks/gpu_speed.sh        # call A: the peer builds (setsid, all cores) while the
#                                                            # GPU tests run; it survives into a call made within 30 s
#   STEPS="peer decode" bash benchmarks/gpu_speed.sh        # call B: llama.cpp and our generate loop, then our graphs
#   STEPS="build gguf tests" PEER_LAYERS=12, then STEPS="peer offload" PEER_LAYERS=12 PEER_NCMOE=6,9
#     PEER_EMBED_SCALE=50 PEER_OURS="expert_cache_slots=64;expert_cache_slots=32" (offload beside the peer)
# Knobs: DECODE_ARMS (name:flags[@XLA_FLAGS];...), DECODE_WINDOWS, PEER_LAYERS, PEER_OURS, PEER_NCMOE,
# PEER_SAMPLING (the peer's sampled arms: llama-completion with e.g. temperature=0.7,top_k=20,top_p=0.8), PEER_XLA (our
# arms again under these XLA flags), PEER_QUANT (llama-quantize types, e.g. Q4_K_M,Q2_K: both engines on each file),
# PROFILE_LAYERS, PROFILE_XLA.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-out}; R=$OUT/speed; mkdir -p "$R"
STEPS=${STEPS:-"build tests"}
LLAMA=/tmp/llama.cpp
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
step() { local name=$1 limit=$2; shift 2; echo "[$name] $*"; local t0=$SECONDS
  timeout "$limit" "$@" > "$R/$name.log" 2>&1; local rc=$?
  echo "[$name] rc=$rc in $((SECONDS - t0)) s"; grep -E '^\|' "$R/$name.log" | tail -14
  grep -E "bandwidth \(|error|passed|failed" "$R/$name.log" | tail -4; }
for s in $STEPS; do case $s in
build)
  if [ -f .peer/llama.tar.xz ] && [ ! -x $LLAMA/build/bin/llama-bench ]; then
    echo "[build] llama-bench from .peer/llama.tar.xz, setsid, all cores; log $LLAMA.log"
    setsid nohup nice -n 19 bash benchmarks/peer/build_llama.sh "$PWD/.peer/llama.tar.xz" $LLAMA > /dev/null 2>&1 < /dev/null &
  fi ;;
tests)
  step tests ${TESTS_LIMIT_S:-420} python3 -m pytest -q -p no:cacheprovider -x ${TESTS_K:+-k "$TESTS_K"} tests/engine/test_gpu.py \
    tests/kernels/test_gpu_kernels.py
  echo "[build] $(cat $LLAMA.done 2>/dev/null || echo running: $(tail -1 $LLAMA.log 2>/dev/null | cut -c1-60))" ;;
decode)
  IFS=';' read -ra arms <<< "${DECODE_ARMS:-"scan_xla:;scan_pallas:--expert_kernel=pallas --attention_kernel=pallas"}"
  for arm in "${arms[@]}"; do
    name=${arm%%:*}; args=${arm#*:}; xla=""
    if [[ "$args" == *@* ]]; then xla=${args#*@}; args=${args%%@*}; fi
    step "decode_$name" ${DECODE_LIMIT_S:-200} env XLA_FLAGS="$xla" python3 -m benchmarks.decode_bench --model=qwen3-30b-a3b \
      --windows=${DECODE_WINDOWS:-1,2,4,8} --hf=off --iters=20 --probe_windows=2 --json=$R/decode_$name.json $args
  done ;;
profile)
  step profile 150 env XLA_FLAGS="${PROFILE_XLA:-}" python3 -m benchmarks.profile_window --model=qwen3-30b-a3b \
    --layers=${PROFILE_LAYERS:-12} --windows=1,4 --iters=10 --expert_kernel=pallas --attention_kernel=pallas \
    --json=$R/profile.json ;;
gguf)  # the peer's F16 GGUF of PEER_LAYERS layers, written under setsid once the build has unpacked gguf-py
  setsid nohup nice -n 19 bash -c "while [ ! -d $LLAMA/gguf-py ]; do sleep 2; done; python3 benchmarks/peer/write_gguf.py \
    --out=/tmp/gguf.part --model=qwen3-30b-a3b --layers=${PEER_LAYERS:-24} --gguf_py=$LLAMA/gguf-py > /tmp/gguf.log 2>&1 \
    && mv /tmp/gguf.part /tmp/qwen3-30b-a3b-${PEER_LAYERS:-24}.gguf; echo rc=\$? > /tmp/gguf.done" > /dev/null 2>&1 < /dev/null &
  echo "[gguf] writing /tmp/qwen3-30b-a3b-${PEER_LAYERS:-24}.gguf under setsid (log /tmp/gguf.log)" ;;
offload)  # the offload arms (spread routing), the native offload calls against the graph path, in one process
  step offload ${OFFLOAD_LIMIT_S:-400} python3 -m benchmarks.offload_bench --model=qwen3-30b-a3b \
    --layers=${OFFLOAD_LAYERS:-12} --slot_fracs=${OFFLOAD_FRACS:-0.5,0.25} --pcie_fracs=${OFFLOAD_PCIE:-auto,1,0} \
    --pool_calls=${OFFLOAD_CALLS:-auto,layer} --embed_scale=50 --new_tokens=64 --json=$R/offload.json ${OFFLOAD_ARGS:-}
  if [ -n "${OFFLOAD_INT4:-}" ]; then  # int4 experts at these slot fractions against the bf16 arms above
    step offload_int4 ${OFFLOAD_LIMIT_S:-400} python3 -m benchmarks.offload_bench --model=qwen3-30b-a3b \
      --layers=${OFFLOAD_LAYERS:-12} --slot_fracs=$OFFLOAD_INT4 --pcie_fracs=1 --pool_calls=auto --expert_dtype=int4 \
      --embed_scale=50 --new_tokens=64 --json=$R/offload_int4.json
  fi ;;
peer)
  t0=$SECONDS; while [ -f .peer/llama.tar.xz ] && [ ! -f $LLAMA.done ] && [ $((SECONDS - t0)) -lt ${BUILD_WAIT_S:-240} ]; do sleep 5; done
  while [ -f /tmp/gguf.log ] && [ ! -f /tmp/gguf.done ] && [ $((SECONDS - t0)) -lt ${BUILD_WAIT_S:-240} ]; do sleep 5; done
  echo "[peer] build: $(cat $LLAMA.done 2>/dev/null || echo 'not done') (waited $((SECONDS - t0)) s); gguf: $(cat /tmp/gguf.done 2>/dev/null)"
  step peer ${PEER_LIMIT_S:-420} python3 -m benchmarks.peer_bench --layers=${PEER_LAYERS:-24} --llama_bench=${PEER_LLAMA-$LLAMA/build/bin/llama-bench} \
    --gguf_py=$LLAMA/gguf-py --ours="${PEER_OURS:-default;spec=0}" --ncmoe="${PEER_NCMOE:-}" \
    --peer_sampling="${PEER_SAMPLING:-}" --quant="${PEER_QUANT:-}" \
    --embed_scale=${PEER_EMBED_SCALE:-1} --json=$R/peer.json
  if [ -n "${PEER_LAYERS2:-}" ]; then  # our arms at a second depth (no peer there: its GGUF would not fit the disk)
    step peer_ours2 ${PEER2_LIMIT_S:-200} python3 -m benchmarks.peer_bench --layers=$PEER_LAYERS2 --llama_bench= \
      --ours="${PEER_OURS:-default;spec=0}" --json=$R/peer_ours_$PEER_LAYERS2.json
  fi
  if [ -n "${PEER_XLA:-}" ]; then
    step peer_xla 300 env XLA_FLAGS="$PEER_XLA" python3 -m benchmarks.peer_bench --layers=${PEER_LAYERS:-24} \
      --llama_bench= --ours="${PEER_OURS:-default;spec=0}" --json=$R/peer_xla.json
  fi ;;
*) echo "unknown step $s" ;;
esac; done
tar czf "$OUT/speed.tar.gz" -C "$OUT" speed && rm -rf "$R"
