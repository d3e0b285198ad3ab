# For the next GPU session (written 2026-12-06, not run): one call, no peer build.
# 1. The GPU offload tests on the packed small leaves (19bdbb6) and pcie_frac 0 under lru (4b45781).
# 2. A/B of the packed leaves + one-reduction counters (after) against 795c1c9's body (before: its slots.py and
#    transformer.py, saved beside this script), alternated after / before / after, offload_bench S=E and 50%.
# 3. pcie_frac 0 under lru (now filled from the prefill) beside static, and auto, at 50% / 25%.
set -u; export PYTHONPATH=. PYTHONUNBUFFERED=1 TESTS_COMPILE_GRAPHS=lazy; S=benchmarks/results/h200-2026-12-06-offload/scripts
timeout 200 python3 -m pytest -v -p no:cacheprovider -o console_output_style=classic \
  -k "offload_is_exact or blocks_of_experts" tests/engine/test_gpu.py > $OUT/tests.log 2>&1
echo "tests rc=$?"; grep -E "PASS|FAIL|ERROR|passed|failed" $OUT/tests.log | tail -9
A="--model=qwen3-30b-a3b --layers=12 --slot_fracs=1.0,0.5 --pcie_fracs=1 --embed_scale=50 --new_tokens=64"
cp strata_jax/offload/slots.py /tmp/slots_after.py; cp strata_jax/model/transformer.py /tmp/transformer_after.py
for v in after before after2; do
  if [ $v = before ]; then gunzip -c $S/slots_795c1c9.py.gz > strata_jax/offload/slots.py; gunzip -c $S/transformer_795c1c9.py.gz > strata_jax/model/transformer.py
  else cp /tmp/slots_after.py strata_jax/offload/slots.py; cp /tmp/transformer_after.py strata_jax/model/transformer.py; fi
  timeout 80 python3 -m benchmarks.offload_bench $A --json=$OUT/ab_$v.json > $OUT/ab_$v.log 2>&1; echo "$v rc=$?"
  grep -E "^\| (all|S=)" $OUT/ab_$v.log | cut -c1-200
done
timeout 200 python3 -m benchmarks.offload_bench --model=qwen3-30b-a3b --layers=12 --slot_fracs=0.5,0.25 \
  --pcie_fracs=0,auto,1 --embed_scale=50 --new_tokens=64 --json=$OUT/split.json > $OUT/split.log 2>&1
echo "split rc=$?"; grep -E "^\| (all|S=)|pcie_frac: " $OUT/split.log | cut -c1-220
# 4. The pool's team against the host's other threads: on the 2-core VM a job of 2 OpenMP threads took 64 us to 16 ms
#    (a descheduled thread holds the barrier) while another process ran, 6 us on 1 thread; the engine's 16-thread team
#    shares 16 cores with the offload worker, Python's dispatch and XLA's threads. Static pcie_frac 0 at 50%, threads
#    16 / 15 / 14 in one process.
timeout 150 python3 -m benchmarks.offload_bench --model=qwen3-30b-a3b --layers=12 --slot_fracs=0.5 --pcie_fracs=0 \
  --cache_policy=static --cpu_threads=16 --embed_scale=50 --new_tokens=64 > $OUT/threads16.log 2>&1
for t in 15 14; do timeout 100 python3 -m benchmarks.offload_bench --model=qwen3-30b-a3b --layers=12 --slot_fracs=0.5 \
  --pcie_fracs=0 --cache_policy=static --cpu_threads=$t --embed_scale=50 --new_tokens=64 > $OUT/threads$t.log 2>&1; done
for t in 16 15 14; do echo "threads $t: $(grep -E '^\| S=' $OUT/threads$t.log | cut -c1-150)"; done
# 5. The deferral through the native calls in the scanned body (this session's last commit): the agent-turns A/B of
#    gpu_run.sh's agent_defer16 (the reference model, 16 slots, pcie_frac 0.5), now without io_callbacks.
timeout 330 python3 -m benchmarks.agent_turns_bench --model=reference --expert_cache_slots=16 --pcie_frac=0.5 \
  --turns=8 --sessions=1 --max_prompt_tokens=900 \
  --arms="base:;every:STRATA_VERIFY_DEFER_CPU=1,STRATA_VERIFY_DEFER_CPU_BELOW=1;split:STRATA_VERIFY_DEFER_CPU=1;check:STRATA_VERIFY_DEFER_CPU=check" \
  --json=$OUT/agent_defer16.json > $OUT/agent_defer16.log 2>&1
echo "defer rc=$?"; grep -E "^\|" $OUT/agent_defer16.log | tail -8
# 6. The plan kernel (pallas_kernels/slot_plan.py, engine option plan_kernel=pallas, off by default): its GPU test,
#    then the fixed cost a layer with and without it in one process each, alternated.
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/offload/test_slot_plan.py -k "kernel" > $OUT/plan_tests.log 2>&1
echo "plan kernel tests rc=$?"; tail -2 $OUT/plan_tests.log
for k in xla pallas xla2; do timeout 80 python3 -m benchmarks.offload_bench --model=qwen3-30b-a3b --layers=12 \
  --slot_fracs=1.0,0.5 --pcie_fracs=1 --embed_scale=50 --new_tokens=64 --plan_kernel=${k%2} > $OUT/plan_$k.log 2>&1
  echo "$k: $(grep -E '^\| (all|S=)' $OUT/plan_$k.log | cut -c1-120 | tr '\n' ' ')"; done
