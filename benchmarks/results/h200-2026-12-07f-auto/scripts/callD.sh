# Call D (issue 34's fixed cost a layer, target 0.03 ms): the optimized HLO of the scanned T=1 layer body, all resident
# against S=E through the offload path (body_hlo.py, 4 layers); then offload_bench on 12 layers, S=E / 50% / 25%, PCIe
# only, beside all resident (the fixed cost a layer and the share of the bytes bound, as the sixth session measured);
# then (issue 33) the pool alone at 64 slots with the default build, with ROWS_DOWN=8 (STRATA_POOL_DEFINES; call B's
# measure.py: a 1-expert job 12% faster alone) and with the team spinning 1000 us but yielding its cores
# (TEAM_SPIN_US=1000,TEAM_SPIN_YIELD=1: alone, the spin cut a 1-expert job from 193 to 121 us; unyielding, it cost
# the engine 18-20%), mirrored: default, Y, R8, R8, Y, default (as time allows).
set -u; export PYTHONPATH=. PYTHONUNBUFFERED=1; T0=$SECONDS; D=$OUT/cD; mkdir -p $D
nvidia-smi --query-gpu=name --format=csv,noheader; git log --oneline -1 | cut -c1-80
timeout 150 python3 benchmarks/results/h200-2026-12-07f-auto/scripts/body_hlo.py $D > $D/body_hlo.log 2>&1
echo "body rc=$? at $((SECONDS - T0)) s"; grep -vE "^W1|cuda_timer" $D/body_hlo.log | head -60
timeout 240 python3 -m benchmarks.offload_bench --model=qwen3-30b-a3b --layers=12 --slot_fracs=1.0,0.5,0.25 \
  --pcie_fracs=1 --embed_scale=50 --new_tokens=64 --json=$D/offload.json > $D/offload.log 2>&1
echo "offload rc=$? at $((SECONDS - T0)) s"; grep -E "^\| (all|S=)|rror|fixed|over all" $D/offload.log | cut -c1-250
P="python3 -m benchmarks.offload_bench --model=qwen3-30b-a3b --layers=12 --slot_fracs=0.5 --pcie_fracs=0 --embed_scale=50 --new_tokens=64"
for arm in default Y R8 R8b Yb defaultb; do
  [ $((SECONDS - T0)) -lt 520 ] || break
  case $arm in R8*) export STRATA_POOL_DEFINES=ROWS_DOWN=8;; Y*) export STRATA_POOL_DEFINES=TEAM_SPIN_US=1000,TEAM_SPIN_YIELD=1;;
    *) unset STRATA_POOL_DEFINES;; esac
  timeout 75 $P --json=$D/pool-$arm.json > $D/pool-$arm.log 2>&1
  echo "pool $arm rc=$? at $((SECONDS - T0)) s"; grep -E "^\\| S=|rror" $D/pool-$arm.log | cut -c1-200; grep -o "STRATA_POOL_DEFINES=[A-Z0-9_=,]*" $D/pool-$arm.log | head -1
done
# Last, as time allows: a 1-expert job alone with the workers' run delay and switches (no core, or asleep?)
[ $((SECONDS - T0)) -lt 540 ] && timeout 50 python3 -m host_pool.measure --threads=16 --experts=1 --formats=bf16 \
  --windows=1 --paths=C --timeline --gap-us=150 --hot-intermediate=0 \
  --variants="default TEAM_SPIN_US=1000 TEAM_SPIN_US=1000,TEAM_SPIN_YIELD=1" > $D/small-e1.log 2>&1 \
  && grep -E "^bf16|timeline|workers" $D/small-e1.log | cut -c1-200
tar czf $OUT/cD.tgz -C $OUT cD; echo "done at $((SECONDS - T0)) s"
