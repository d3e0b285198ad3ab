# Call 3 (issue 33): the quantized pool jobs' ~0.41 ms whatever their bytes (the ninth session, 16 Intel cores):
# the mean job's timeline (setup, the team's wake-up, phase 1 = gate/up, phase 2 = down) per format at 16 and 8
# threads, back to back and with 300 us of device time between jobs (the kept team's workers spin 200 us, then
# sleep); then the prefetch distance (PREFETCH_BYTES, default 2048) at 16 threads.
set -u; export PYTHONPATH=. PYTHONUNBUFFERED=1; T0=$SECONDS; D=$OUT/c3; mkdir -p $D
nvidia-smi --query-gpu=name --format=csv,noheader; lscpu | grep -E "Model name|^CPU\(s\)|Thread" ; git log --oneline -1 | cut -c1-80
for th in 16 8; do for gap in 0 300; do
  timeout 100 python3 -m host_pool.measure --threads=$th --formats=bf16,int8,int4 --windows=1 --paths=C --timeline \
    --gap-us=$gap > $D/pool-t$th-gap$gap.log 2>&1
  echo "threads $th gap $gap rc=$? at $((SECONDS - T0)) s"; grep -E "^(bf16|int8|int4) |timeline" $D/pool-t$th-gap$gap.log | cut -c1-170
done; done
timeout 150 python3 -m host_pool.measure --threads=16 --formats=int8,int4 --windows=1 --paths=C \
  --variants="default PREFETCH_BYTES=0 PREFETCH_BYTES=1024 PREFETCH_BYTES=4096 PREFETCH_BYTES=8192" > $D/pool-prefetch.log 2>&1
echo "prefetch rc=$? at $((SECONDS - T0)) s"; grep -E "^(int8|int4)" $D/pool-prefetch.log | cut -c1-140
echo "done at $((SECONDS - T0)) s"
