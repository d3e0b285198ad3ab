# Call 2 (issue 33): a decode layer's pool job is small (1.43 experts a layer at 64 of 128 slots, spread routing) and
# call 1 timed it at ~198 us in the engine where its 13.5 MB take ~110 us at the read bandwidth. The job's timeline
# (setup, the team's entry, phase 1, phase 2) for 1 and 2 experts, bf16, 150 us between jobs (the device's share of
# a layer), 16 and 14 threads; builds: default, smaller phase-1 blocks (ROWS_UP=16), smaller phase-2 blocks
# (ROWS_DOWN=8), the team spinning 1000 us.
# First: call 1's pool-alone arm again with the worker's ring (STRATA_OFFLOAD_TIMELINE): each decode job's POSTED
# seen and DONE on the clock of the tokens' read times, to see where the ~1.1 ms a token that the worker's busy time
# and its gaps do not cover goes (call 1: 5.04 ms a token, 12 x (198 + 131) us = 3.95 ms of jobs and gaps).
set -u; export PYTHONPATH=. PYTHONUNBUFFERED=1; T0=$SECONDS; D=$OUT/c2; mkdir -p $D
B="python3 -m benchmarks.offload_bench --model=qwen3-30b-a3b --layers=12 --embed_scale=50 --new_tokens=64 --slot_fracs=0.5 --pcie_fracs=0"
# Since call 1 the slots filled from the prefill (pcie_frac 0) copy only the experts not in a slot already and the
# fill is waited for (slot_fill_s), not decode time. Then the same at 25%, and pcie_frac auto and 1 at both shares.
STRATA_OFFLOAD_TIMELINE=100000 timeout 70 $B --json=$D/pool-ring.json > $D/pool-ring.log 2>&1
echo "pool ring rc=$? at $((SECONDS - T0)) s"; grep -E "offload worker|decode jobs|tok/s \(|slots filled" $D/pool-ring.log | cut -c1-260
timeout 150 ${B/--slot_fracs=0.5 --pcie_fracs=0/--slot_fracs=0.5,0.25 --pcie_fracs=0,auto,1} --json=$D/offload.json > $D/offload.log 2>&1
echo "offload rc=$? at $((SECONDS - T0)) s"; grep -E "^\| |slots filled|pcie_frac .* at start" $D/offload.log | cut -c1-200 | head -14
V="default ROWS_UP=16 ROWS_DOWN=8 TEAM_SPIN_US=1000"
for e in 1 2; do for th in 16 14; do
  timeout 80 python3 -m host_pool.measure --threads=$th --experts=$e --formats=bf16 --windows=1 --paths=C --timeline \
    --gap-us=150 --hot-intermediate=0 --variants="$V" > $D/small-e$e-t$th.log 2>&1
  echo "experts $e threads $th rc=$? at $((SECONDS - T0)) s"; grep -E "^bf16|timeline" $D/small-e$e-t$th.log | cut -c1-200
done; done
tar czf $OUT/c2.tgz -C $OUT c2; echo "done at $((SECONDS - T0)) s"
