#!/usr/bin/env bash
# The one script the team runs on the GPU machine, in a single call from the repository root:
#
#     bash benchmarks/gpu_run.sh [extra decode_bench flags, e.g. --layers=8]
#
# Everything lands under $OUT (default ./out): env.txt, <step>.log, <step>.json, steps.txt (one line per step:
# name, exit status, seconds). Each step runs under its own time limit and a failure does not stop the next one;
# the script exits 1 if any step failed. To add a step: one more `step NAME LIMIT_S command...` line below.
#
# On the GPU machine the repository's pinned .venv is not used: the image's python3 has jax (CUDA), absl, numpy,
# flax, orbax. Override with PY=..., the limits with SMOKE_LIMIT_S=... / DECODE_LIMIT_S=... / OFFLOAD_LIMIT_S=..., the
# decode flags with DECODE_ARGS="...", the offload flags with OFFLOAD_ARGS="...".
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-1}
JIT_CACHE=${JIT_CACHE:-/tmp/strata_jax_jit_cache}  # persistent compilation cache: a rerun on a warm machine is faster
FAILED=0
: > "$OUT/steps.txt"

# STEPS="decode offload" runs only those steps (one device call is at most 10 minutes: the three together are
# longer, so run them in separate calls). Default: all.
STEPS=${STEPS:-all}

# step NAME LIMIT_S command...: run it with stdout+stderr to the screen and $OUT/NAME.log; record the status.
step() {
  local name=$1 limit=$2
  shift 2
  if [ "$STEPS" != all ] && [[ " $STEPS " != *" $name "* ]]; then
    echo "=== step $name: skipped (STEPS=$STEPS)"
    return 0
  fi
  echo
  echo "=== step $name (limit ${limit}s): $*"
  local t0=$SECONDS
  timeout --kill-after=15 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  local dt=$((SECONDS - t0))
  [ "$rc" -eq 124 ] && echo "=== step $name: timed out after ${limit}s"
  echo "=== step $name: exit $rc after ${dt}s"
  echo "$name rc=$rc ${dt}s" >> "$OUT/steps.txt"
  [ "$rc" -ne 0 ] && FAILED=1
  return 0
}

# The machine: GPUs, versions, what JAX sees (also in $OUT/env.txt).
{
  echo "=== env"
  echo "date: $(date -u +%FT%TZ)  host: $(hostname)  repo: $(pwd)"
  nvidia-smi -L || echo "(no nvidia-smi)"
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.memory,driver_version --format=csv || true
  echo "cpus: $(nproc)  memory: $(free -g 2>/dev/null | awk '/Mem:/ {print $2 " GiB"}')"
  timeout 120 "$PY" -c '
import sys, jax, jaxlib, numpy, flax, absl
print("python", sys.version.split()[0], "| jax", jax.__version__, "| jaxlib", jaxlib.__version__,
      "| flax", flax.__version__, "| numpy", numpy.__version__)
print("backend:", jax.default_backend(), "| devices:", jax.devices())' || echo "python/jax check failed"
} 2>&1 | tee "$OUT/env.txt"

# A 2-layer smoke run first (tens of seconds): catches a broken path before the long run, and gives early numbers.
step decode_smoke "${SMOKE_LIMIT_S:-180}" "$PY" -m benchmarks.decode_bench --model=qwen3-30b-a3b --layers=2 --windows=1,4 --iters=10 \
  --json="$OUT/decode_smoke.json" --compilation_cache_dir="$JIT_CACHE"

# The full model: 48 layers, ~61 GB of bf16 random weights, all experts resident.
step decode "${DECODE_LIMIT_S:-480}" "$PY" -m benchmarks.decode_bench --model=qwen3-30b-a3b --windows=1,2,4,8 --context=2048 --pos=512 \
  --dtype=bfloat16 --iters=30 --warmup=3 --json="$OUT/decode.json" --compilation_cache_dir="$JIT_CACHE" \
  ${DECODE_ARGS:-} "$@"

# Offload: experts in pinned host memory behind a device cache of S = 100/50/25/10 % of the experts, PCIe-only and
# auto PCIe/host-pool split, against all experts resident; copy bandwidths measured in the same run. 12 of 48 layers
# (the default cut): the host holds the experts twice (pinned + numpy for the pool), 2 x 14.5 GB here.
step offload "${OFFLOAD_LIMIT_S:-420}" "$PY" -m benchmarks.offload_bench --model=qwen3-30b-a3b --dtype=bfloat16 \
  --json="$OUT/offload.json" --cache_dir="$JIT_CACHE" ${OFFLOAD_ARGS:-}

# Long prompts: what a user waits for. TTFT (the prefill of the whole prompt) and decode tok/s deep in the context at
# LONG_PROMPTS tokens, every expert resident and LONG_FRACS of the experts in slots (pcie_frac=1), qwen3-30b-a3b cut
# to 24 layers, beside llama.cpp's pp<N> / tg @ d<N> when LONG_LLAMA is a llama-bench binary (the default is
# gpu_speed.sh's build; absent: the peer columns say '-' and why; LONG_LLAMA= turns it off). The JSON is rewritten
# after each request and the time limit's SIGTERM prints the rows measured so far. LONG_ARGS: more flags (--arms=...).
step long_context "${LONG_LIMIT_S:-560}" "$PY" -m benchmarks.long_context_bench --model=qwen3-30b-a3b --layers=24 \
  --prompts="${LONG_PROMPTS:-4096,32768}" --slot_fracs="${LONG_FRACS:-all,0.5,0.25}" \
  --llama_bench="${LONG_LLAMA-/tmp/llama.cpp/build/bin/llama-bench}" --gguf_py=/tmp/llama.cpp/gguf-py \
  --cache_dir="$JIT_CACHE" --json="$OUT/long_context.json" ${LONG_ARGS:-}

# Past one GPU (issue 20): needs the 2-GPU machine (nvidia-h200-x2; on one GPU the 2-device rows are skipped, one
# line). The 30B shape, T=1 decode: 1 GPU all resident, 2 GPUs all resident (parallel=layers, parallel=experts), and
# 1 GPU with offload and room for half the weights (vram_reserve_mib = bytes_limit - weights / 2,
# expert_cache_slots=auto: a GPU the model does not fit, two of which hold it); the ratio of 2
# GPUs to the offloaded GPU below the table (target >= 3x). The time limit's SIGTERM prints the rows measured so far.
step parallel "${PARALLEL_LIMIT_S:-560}" "$PY" -m benchmarks.parallel_bench --model=qwen3-30b-a3b --dtype=bfloat16 \
  --devices=1,2 --modes=layers,experts --json="$OUT/parallel.json" --cache_dir="$JIT_CACHE" ${PARALLEL_ARGS:-}

# Decode deep in the context (issue 21): one T=1 window at position DEEP_POS of a DEEP_POS + 1024 cache, the
# 30B shape cut to 24 layers; the Pallas decode attention with its auto splits, with 16 splits (the old default),
# and XLA's einsums over the whole static cache.
DEEP=(--model=qwen3-30b-a3b --layers=24 --windows=1 --context=$(( ${DEEP_POS:-32768} + 1024 )) --pos=${DEEP_POS:-32768}
  --iters=30 --hf=off --expert_kernel=pallas --compilation_cache_dir="$JIT_CACHE")
step decode_deep_pallas "${DEEP_LIMIT_S:-120}" "$PY" -m benchmarks.decode_bench "${DEEP[@]}" --attention_kernel=pallas \
  --json="$OUT/decode_deep_pallas.json"
step decode_deep_splits16 "${DEEP_LIMIT_S:-120}" "$PY" -m benchmarks.decode_bench "${DEEP[@]}" --attention_kernel=pallas \
  --attention_splits=16 --json="$OUT/decode_deep_splits16.json"
step decode_deep_xla "${DEEP_LIMIT_S:-120}" "$PY" -m benchmarks.decode_bench "${DEEP[@]}" --attention_kernel=xla \
  --json="$OUT/decode_deep_xla.json"

# The GPU-only tests: compiled Pallas kernels against their references, pinned memory, exact offload, pool faults.
# Kernel checks first, then the engine tests (each builds engines that compile every window graph: the first 6
# took 140 s on the H200). The 27 items need most of a call: run this step alone with GPU_TESTS_LIMIT_S=560.
step gpu_tests "${GPU_TESTS_LIMIT_S:-240}" "$PY" -m pytest -q -m gpu --durations=8 tests/kernels/test_gpu_kernels.py tests/engine/test_gpu.py

# Kernels beside their XLA paths, timed in one run with the copy bandwidth as roofline.
step route_prior "${KERNEL_LIMIT_S:-120}" "$PY" -m benchmarks.route_prior_bench --json="$OUT/route_prior.json"
step expert_ffn "${KERNEL_LIMIT_S:-180}" "$PY" -m benchmarks.expert_ffn_bench --json="$OUT/expert_ffn.json"

# The routing approximations (issue 5): at 50% and 25% of the experts, PCIe only, each arm's ratio to the plain
# engine, interleaved and mirrored. R = K - 3 = 5 for top-8.
step route_arms "${ARMS_LIMIT_S:-420}" "$PY" -m benchmarks.offload_bench --model=qwen3-30b-a3b --dtype=bfloat16 \
  --slot_fracs=0.5,0.25 --pcie_fracs=1 --new_tokens=48 --json="$OUT/route_arms.json" --cache_dir="$JIT_CACHE" \
  --switch_arms="skip:STRATA_ROUTE_TAIL_SKIP=5;prior:STRATA_ROUTE_PRIOR=0.5;both:STRATA_ROUTE_TAIL_SKIP=5,STRATA_ROUTE_PRIOR=0.5;resident:STRATA_ROUTE_RESIDENT=1" \
  ${ROUTE_ARMS_ARGS:-}

# Deferred CPU rows (issue 6): a large CPU share (pcie_frac 0 and 0.5).
step defer_arms "${ARMS_LIMIT_S:-420}" "$PY" -m benchmarks.offload_bench --model=qwen3-30b-a3b --dtype=bfloat16 \
  --slot_fracs=0.5 --pcie_fracs=0,0.5 --new_tokens=32 --json="$OUT/defer_arms.json" --cache_dir="$JIT_CACHE" \
  --switch_arms="every:STRATA_VERIFY_DEFER_CPU=1,STRATA_VERIFY_DEFER_CPU_BELOW=1;split:STRATA_VERIFY_DEFER_CPU=1;check:STRATA_VERIFY_DEFER_CPU=check" \
  ${DEFER_ARMS_ARGS:-}

# The Pallas expert FFN in the whole decode step (issue 8), every expert resident, KERNEL_LAYERS of 48 layers (default
# 8; 0 = all 48): XLA (beside HF transformers when torch is there), the expert kernel, both kernels.
KERNEL_LAYERS=${KERNEL_LAYERS:-8}
KERNEL_WINDOWS=${KERNEL_WINDOWS:-1,2,4,8}
PROFILE_WINDOWS=${PROFILE_WINDOWS:-1,4}
# Where a window's device time goes, by named scope (issue 8's per-phase profile), XLA and both Pallas kernels.
step profile "${PROFILE_LIMIT_S:-150}" bash -c "$PY -m benchmarks.profile_window --model=qwen3-30b-a3b --layers=8 --windows=$PROFILE_WINDOWS \
  --json=$OUT/profile_xla.json && $PY -m benchmarks.profile_window --model=qwen3-30b-a3b --layers=8 --windows=$PROFILE_WINDOWS \
  --expert_kernel=pallas --attention_kernel=pallas --json=$OUT/profile_pallas.json"
step decode_attention "${DECODE_KERNEL_LIMIT_S:-150}" "$PY" -m benchmarks.decode_bench --model=qwen3-30b-a3b --layers=$KERNEL_LAYERS \
  --windows=$KERNEL_WINDOWS --context=2048 --pos=512 --iters=30 --attention_kernel=pallas --expert_kernel=pallas --hf=off \
  --json="$OUT/decode_attention.json" --compilation_cache_dir="$JIT_CACHE"
# The same with XLA's command buffers (CUDA graphs) off: what they save in launches.
step decode_cmdbuf_off "${DECODE_KERNEL_LIMIT_S:-150}" env XLA_FLAGS="--xla_gpu_enable_command_buffer= ${XLA_FLAGS:-}" \
  "$PY" -m benchmarks.decode_bench --model=qwen3-30b-a3b --layers=$KERNEL_LAYERS --windows=$KERNEL_WINDOWS --context=2048 \
  --pos=512 --iters=30 --attention_kernel=pallas --expert_kernel=pallas --hf=off --json="$OUT/decode_cmdbuf_off.json"
for kernel in xla pallas; do
  step "decode_$kernel" "${DECODE_KERNEL_LIMIT_S:-150}" "$PY" -m benchmarks.decode_bench --model=qwen3-30b-a3b --layers=$KERNEL_LAYERS \
    --windows=$KERNEL_WINDOWS --context=2048 --pos=512 --iters=30 --expert_kernel=$kernel --json="$OUT/decode_$kernel.json" \
    --compilation_cache_dir="$JIT_CACHE" ${KERNEL_DECODE_ARGS:-}
done

# The Pallas expert FFN in the offload path (issue 8): 50% and 25% of the experts, PCIe only, XLA then Pallas.
for kernel in xla pallas; do
  step "offload_$kernel" "${OFFLOAD_KERNEL_LIMIT_S:-240}" "$PY" -m benchmarks.offload_bench --model=qwen3-30b-a3b \
    --dtype=bfloat16 --slot_fracs=${OFFLOAD_KERNEL_FRACS:-1.0,0.5,0.25} --pcie_fracs=1 --new_tokens=48 --expert_kernel=$kernel \
    --json="$OUT/offload_$kernel.json" --cache_dir="$JIT_CACHE"
done

# The agent-turns A/B (issue 7) on the reference model: routing arms at a quarter of the experts, PCIe only.
step agent_turns "${AGENT_LIMIT_S:-300}" "$PY" -m benchmarks.agent_turns_bench ${AGENT_ARGS:-} --json="$OUT/agent_turns.json" \
  --plot="$OUT/agent_turns.png"

# Issue 7's tables, one A/B per step (each ~5 minutes on the H200; CPU_THREADS: the host pool's threads, 0 = the
# cores this process may use). agent_route16/32: the routing arms at 25% / 50% of the 64 experts, PCIe only, 24
# turns; agent_defer16/32: the deferred CPU rows at pcie_frac 0.5, 8 turns; agent_draft_all/16: the n-gram drafts
# on the host against on the device.
AGENT=("$PY" -m benchmarks.agent_turns_bench --model=reference --cache_dir="$JIT_CACHE" --cpu_threads="${CPU_THREADS:-0}")
ROUTE_ARMS="base:;skip:STRATA_ROUTE_TAIL_SKIP=5;prior:STRATA_ROUTE_PRIOR=0.5;both:STRATA_ROUTE_TAIL_SKIP=5,STRATA_ROUTE_PRIOR=0.5;resident:STRATA_ROUTE_RESIDENT=1"
DEFER_ARMS="base:;every:STRATA_VERIFY_DEFER_CPU=1,STRATA_VERIFY_DEFER_CPU_BELOW=1;split:STRATA_VERIFY_DEFER_CPU=1;check:STRATA_VERIFY_DEFER_CPU=check"
for slots in 16 32; do
  step "agent_route$slots" "${AGENT_LIMIT_S:-330}" "${AGENT[@]}" --expert_cache_slots=$slots --pcie_frac=1 \
    --arms="$ROUTE_ARMS" --json="$OUT/agent_route$slots.json" --plot="$OUT/agent_route$slots.png"
  step "agent_defer$slots" "${AGENT_LIMIT_S:-330}" "${AGENT[@]}" --expert_cache_slots=$slots --pcie_frac=0.5 \
    --turns=8 --sessions=1 --max_prompt_tokens=900 --arms="$DEFER_ARMS" --json="$OUT/agent_defer$slots.json" \
    --plot="$OUT/agent_defer$slots.png"
done
for slots in all 16; do
  step "agent_draft_$slots" "${DRAFT_LIMIT_S:-200}" "${AGENT[@]}" --expert_cache_slots=$slots --pcie_frac=1 \
    --arms="ngram:;device:draft=device" --json="$OUT/agent_draft_$slots.json" --plot="$OUT/agent_draft_$slots.png" \
    ${AGENT_DRAFT_ARGS:-}
done
# KL of every arm against the exact engine, teacher-forced through verify windows (float32).
step kl_arms "${KL_LIMIT_S:-420}" "$PY" -m benchmarks.kl_arms --cache_dir="$JIT_CACHE" --cpu_threads="${CPU_THREADS:-0}" \
  --json="$OUT/kl_arms.json"

# Quantized experts (issue 16): the generate loop at the 30B shape cut to OFFLOAD layers, bf16, int8 and int4 experts
# at 50% and 25% of the experts in slots (PCIe fetches only), one step each in one call; then the gpu-marked
# quantized tests (the kernels inside the engine).
# QUANT_ARGS="--embed_scale=50" spreads the random weights' routing (offload_bench's flag). The *_cb steps run the
# same with XLA's command buffers taking the while loops and conditionals too (CUDA graph conditional nodes: no
# host round trip per fetch loop or block).
CB_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"
for ed in ${QUANT_DTYPES:-auto int8 int4 int4-q4k}; do  # int4-q4k: GGUF Q4_K's blocks (issue 36)
  step "offload_experts_$ed" "${QUANT_LIMIT_S:-300}" "$PY" -m benchmarks.offload_bench --model=qwen3-30b-a3b \
    --dtype=bfloat16 --expert_dtype=$ed --slot_fracs=${QUANT_FRACS:-0.5,0.25} --pcie_fracs=${QUANT_PCIE:-1} \
    --cache_dir="$JIT_CACHE" --json="$OUT/offload_experts_$ed.json" ${QUANT_ARGS:-}
  step "offload_experts_${ed}_cb" "${QUANT_LIMIT_S:-300}" env XLA_FLAGS="$CB_FLAGS ${XLA_FLAGS:-}" \
    "$PY" -m benchmarks.offload_bench --model=qwen3-30b-a3b \
    --dtype=bfloat16 --expert_dtype=$ed --slot_fracs=${QUANT_FRACS:-0.5,0.25} --pcie_fracs=${QUANT_PCIE:-1} \
    --cache_dir="$JIT_CACHE" --json="$OUT/offload_experts_${ed}_cb.json" ${QUANT_ARGS:-}
done
step quant_gpu_tests "${GPU_TESTS_LIMIT_S:-240}" "$PY" -m pytest -q -m gpu tests/model/test_quant.py tests/model/test_kv_int8.py
# The expert FFN kernel on bf16 / int8 / int4 experts at the 30B shape, and the host pool per format on this host.
step quant_kernels "${KERNEL_LIMIT_S:-180}" "$PY" -m benchmarks.expert_ffn_bench --t=${KERNEL_T:-1,2,4,8} \
  --formats=${KERNEL_FORMATS:-int8,int4,int4-g128,int4-q4k} \
  --json="$OUT/quant_kernels.json"
step pool_formats "${POOL_LIMIT_S:-120}" "$PY" -m strata_jax.host_pool.measure --formats bf16,int8,int4,int4-numpy

echo
echo "=== steps"
cat "$OUT/steps.txt"
exit $FAILED
