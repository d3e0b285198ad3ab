#!/usr/bin/env bash
# Several gpu_run.sh step lists at once, one GPU and an equal share of the host's cores each (a 2-GPU machine
# gives two 1-GPU lanes for the device time of one):
#
#     LANES="agent_route32 agent_draft_all|agent_defer16 agent_defer32" bash benchmarks/gpu_lanes.sh
#
# Lane i runs `STEPS="<i-th list>" bash benchmarks/gpu_run.sh` with CUDA_VISIBLE_DEVICES=i, pinned (taskset) to
# the i-th share of the cores, its host pool sized to that share (CPU_THREADS), within LANES_LIMIT_S (default 540),
# output under $OUT/lane<i>, a log in $OUT/lane<i>.log. At the end every step's table lines are printed and all of it
# is packed into $OUT/all_lanes.tar.gz (the device tool brings back few files). Timed steps in two lanes share the
# host's memory bandwidth and PCIe root: each A/B interleaves its arms, so the other lane disturbs every arm alike.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
IFS='|' read -r -a lanes <<< "${LANES:?LANES=\"steps of lane 0|steps of lane 1|...\"}"
n=${#lanes[@]}
cores=$(nproc)
share=$((cores / n))
if [ "$share" -lt 1 ]; then
  echo "gpu_lanes.sh: $n lanes need at least $n cores (this machine has $cores)" >&2
  exit 1
fi
pin=(taskset -c)
command -v taskset > /dev/null || { echo "gpu_lanes.sh: no taskset here: lanes not pinned to cores"; pin=(); }
pids=()
for i in "${!lanes[@]}"; do
  first=$((i * share)); last=$((first + share - 1))
  echo "=== lane $i: GPU $i, cores $first-$last, steps: ${lanes[$i]}"
  CUDA_VISIBLE_DEVICES=$i CPU_THREADS=$share STEPS="${lanes[$i]}" OUT="$OUT/lane$i" timeout --kill-after=10 \
    "${LANES_LIMIT_S:-540}" ${pin[@]:+"${pin[@]}" "$first-$last"} bash benchmarks/gpu_run.sh > "$OUT/lane$i.log" 2>&1 &
  pids+=($!)
done
FAILED=0
for i in "${!pids[@]}"; do
  wait "${pids[$i]}" || FAILED=1
  echo "=== lane $i done: $(tr '\n' ';' < "$OUT/lane$i/steps.txt" 2>/dev/null)"
done
# The tables of every step, then one archive in place of the many files.
for i in "${!lanes[@]}"; do
  for log in "$OUT/lane$i"/*.log; do
    [ -f "$log" ] || continue
    echo; echo "=== lane $i: $(basename "$log")"
    grep -E '^\|' "$log" | cut -c1-220 || true
  done
done
tar -czf "$OUT/all_lanes.tar.gz" -C "$OUT" $(cd "$OUT" && ls -d lane*) && rm -rf "$OUT"/lane[0-9]*
exit $FAILED
