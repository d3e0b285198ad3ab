# Issue 33 (branch pool-small): the pool's small jobs. One run compares, on the 16-core host, the new C job (a kept
# thread team: spin 200 us after a job, then futex sleep; blocks sized to the job; one barrier) with the former one
# (-DTEAM_OMP,BLOCKS_FIXED: an OpenMP region per job, fixed blocks of 32 / 16 rows) and with the job-sized blocks in
# the former team (-DTEAM_OMP), for 1, 2 and 8 experts at T=1; back-to-back jobs (--gap-us 0), and 100 / 300 us of
# busy wait between jobs (a decode step's device share of a layer: within the team's spin, and past it: the sleep
# path); the idle spin 50 / 200 (default) / 1000 us at 100 and 300 us gaps (TEAM_SPIN_US). The timeline lines: setup,
# the threads that took phase-1 blocks and their first block's start after the job was posted (first .. last: the
# wake-up), phase 1, phase 2, region (us); above them each build's block cut.
# Target: the job's time beyond its bytes (ms/job - bytes / the read bandwidth) <= 0.03 ms. About 2 minutes.
set -u; export PYTHONPATH=. PYTHONUNBUFFERED=1; T0=$SECONDS
lscpu | grep -E "Model name|^CPU\(s\)"; git log --oneline -1 2>/dev/null | cut -c1-100
V="default TEAM_OMP,BLOCKS_FIXED TEAM_OMP"
M="python3 -m strata_jax.host_pool.measure --threads 16 --windows 1 --paths C --read_mb 1024 --hot-intermediate 0 --timeline --repeats 40"
for gap in 0 100 300; do
  for e in 1 2 8; do
    timeout 45 $M --experts $e --formats bf16 --gap-us $gap --variants "$V" > $OUT/small_g${gap}_e$e.log 2>&1
    echo "== bf16, experts $e, gap $gap us: rc=$? at $((SECONDS-T0)) s"
    grep -E "read bandwidth|^bf16|timeline|blocks of" $OUT/small_g${gap}_e$e.log | cut -c1-200
  done
done
for e in 1 8; do
  timeout 45 $M --experts $e --formats int4 --variants "$V" > $OUT/small_int4_e$e.log 2>&1
  echo "== int4, experts $e, gap 0: rc=$? at $((SECONDS-T0)) s"
  grep -E "^int4|timeline|blocks of" $OUT/small_int4_e$e.log | cut -c1-200
done
for gap in 100 300; do
  timeout 45 $M --experts 1 --formats bf16 --gap-us $gap --variants "default TEAM_SPIN_US=50 TEAM_SPIN_US=1000" \
    > $OUT/small_spin_g$gap.log 2>&1
  echo "== bf16, experts 1, gap $gap us, idle spin 200 (default) / 50 / 1000 us: rc=$? at $((SECONDS-T0)) s"
  grep -E "^bf16|timeline" $OUT/small_spin_g$gap.log | cut -c1-200
done
cd $OUT && tar czf pool_small.tgz *.log && echo "done at $((SECONDS-T0)) s"
