#!/bin/bash
# GPU calls for Qwen3-Next (issue 15). Steps run in the order given; logs and JSON land in $OUT/next, tables printed.
#   STEPS="tests delta decode" bash benchmarks/gpu_next.sh     # call 1: kernels and tests, the delta rule, 80B decode
#   STEPS="decode_pallas offload" bash benchmarks/gpu_next.sh  # call 2: the Pallas rule in the model, 25% of experts
#   STEPS="train_ref mtp_turns" bash benchmarks/gpu_next.sh     # the reference-next model ($OUT/next-stdlib), draft=mtp
#   STEPS="mtp_turns kl" NEXT_MODEL=reference-next TURNS_SLOTS=16 bash benchmarks/gpu_next.sh  # at 25% of the experts
# Knobs: NEXT_LAYERS (the 80B shape's cut for decode, default 32 = 107 GB of bf16 weights, within the 112.6 GB XLA gives the
# arrays), OFFLOAD_LAYERS (12).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-out}; R=$OUT/next; mkdir -p "$R"
STEPS=${STEPS:-"tests delta decode"}
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
step() { local name=$1 limit=$2; shift 2; echo "[$name] $*"; local t0=$SECONDS
  timeout "$limit" "$@" > "$R/$name.log" 2>&1; local rc=$?
  echo "[$name] rc=$rc in $((SECONDS - t0)) s"; grep -E '^\|' "$R/$name.log" | tail -16
  grep -E "bandwidth \(|Error|error:|passed|failed|FAILED" "$R/$name.log" | tail -8; }
DECODE="python3 -m benchmarks.decode_bench --model=qwen3-next-80b-a3b --layers=${NEXT_LAYERS:-32} --windows=${NEXT_WINDOWS:-1,2,4}
  --hf=off --iters=20 --probe_windows=2 --context=4096 --pos=1024"
for s in $STEPS; do case $s in
tests)
  step tests ${TESTS_LIMIT_S:-240} python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gated_delta.py \
    tests/model/test_hf_next.py ${TESTS_SEL:--k "gpu or delta_kernel or placement or verify"} ;;
delta)
  for arm in ${DELTA_ARMS:-16:4 32:4 64:4 32:8}; do bw=${arm%:*}; nw=${arm#*:}
    step delta_b${bw}_w${nw} 90 python3 -m benchmarks.delta_bench --block_dv=$bw --num_warps=$nw \
      --json=$R/delta_b${bw}_w${nw}.json
  done ;;
decode)
  step decode_xla ${DECODE_LIMIT_S:-300} $DECODE --delta_kernel=xla --json=$R/decode_xla.json ;;
decode_pallas)
  step decode_pallas ${DECODE_LIMIT_S:-300} $DECODE --delta_kernel=pallas --json=$R/decode_pallas.json ;;
offload)
  step offload ${OFFLOAD_LIMIT_S:-300} python3 -m benchmarks.offload_bench --model=qwen3-next-80b-a3b \
    --layers=${OFFLOAD_LAYERS:-12} --slot_fracs=1.0,0.25 --pcie_fracs=1,auto --new_tokens=64 --json=$R/offload.json ;;
train_ref)  # the committed strata_jax/assets/next-stdlib: copy $OUT/next-stdlib there
  step train_ref ${TRAIN_LIMIT_S:-330} python3 -m training.train_reference --arch=qwen3_next \
    --out=$OUT/next-stdlib --steps=${TRAIN_STEPS:-6000} --time_limit_s=${TRAIN_TIME_S:-200} --log_every=200
  grep -E "^(held-out|MTP module|trained|checkpoint|parameters)" "$R/train_ref.log"
  cp strata_jax/assets/moe-stdlib/tokenizer_config.json strata_jax/assets/moe-stdlib/generation_config.json \
    "$OUT/next-stdlib/" ;;
mtp_turns)  # draft=mtp against draft=ngram on the reference-next model, one run of agent_turns_bench
  slots=${TURNS_SLOTS:-all}
  step mtp_turns_$slots ${TURNS_LIMIT_S:-240} python3 -m benchmarks.agent_turns_bench \
    --model=${NEXT_MODEL:-$OUT/next-stdlib} --arms="ngram:draft=ngram;mtp:draft=mtp" --expert_cache_slots=$slots \
    --json=$R/mtp_turns_$slots.json ${TURNS_ARGS:-} ;;
kl)  # the routing rules' quality on the reference-next model
  step kl ${KL_LIMIT_S:-200} python3 -m benchmarks.kl_arms --model=${NEXT_MODEL:-$OUT/next-stdlib} \
    --json=$R/kl_next.json ${KL_ARGS:-} ;;
*) echo "unknown step $s" ;;
esac; done
tar czf "$OUT/next.tar.gz" -C "$OUT" next && rm -rf "$R"
