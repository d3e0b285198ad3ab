# Call 1 (2026-12-06, fourth session): the signal kernels (a begin posts its plan and a collect waits for y with one
# kernel each, instead of a copy + a flag write and a flag wait + a flag write + a copy) against the stream memory
# operations (STRATA_OFFLOAD_SIGNAL=memops), one process each:
# (a) GPU tests: exact with either;
# (b) the handshake alone: S=E through the offload path, pcie_frac 0 (every layer posts an empty pool job) and 1;
# (c) the pool alone at 50% / 25%: kernel, memops; then the team kept awake (14 threads, idle spin 1000 us).
set -u; export PYTHONPATH=. PYTHONUNBUFFERED=1 TESTS_COMPILE_GRAPHS=lazy; T0=$SECONDS
nvidia-smi --query-gpu=name --format=csv,noheader; lscpu | grep -E "Model name|^CPU\(s\)|Thread\(s\) per core|Core\(s\) per socket|L3"
timeout 170 python3 -m pytest -q -p no:cacheprovider -o console_output_style=classic tests/engine/test_gpu.py \
  -k "offload_is_exact or signal_by_memops or blocks_of_experts" > $OUT/tests.log 2>&1
echo "tests rc=$? at $((SECONDS-T0)) s: $(tail -1 $OUT/tests.log | cut -c1-160)"; grep -E "^(FAILED|ERROR)|Error" $OUT/tests.log | head -5 | cut -c1-200
B="python3 -m benchmarks.offload_bench --model=qwen3-30b-a3b --layers=12 --embed_scale=50 --new_tokens=64"
for sig in kernel memops; do
  STRATA_OFFLOAD_SIGNAL=$sig timeout 80 $B --slot_fracs=1.0 --pcie_fracs=0,1 > $OUT/handshake_$sig.log 2>&1
  echo "handshake $sig rc=$? at $((SECONDS-T0)) s"; grep -E "^\| (S=|all)" $OUT/handshake_$sig.log | cut -c1-200
done
run() {  # name, signal, threads, spin
  STRATA_OFFLOAD_SIGNAL=$2 STRATA_POOL_SPIN_US=$4 timeout 75 $B --slot_fracs=0.5,0.25 --pcie_fracs=0 --cpu_threads=$3 > $OUT/pool_$1.log 2>&1
  echo "pool $1 ($2, $3 threads, spin $4 us) rc=$? at $((SECONDS-T0)) s"; grep -E "^\| (S=|all)" $OUT/pool_$1.log | cut -c1-200
}
[ $((SECONDS-T0)) -lt 400 ] && run kernel kernel 16 200
[ $((SECONDS-T0)) -lt 470 ] && run memops memops 16 200
[ $((SECONDS-T0)) -lt 520 ] && run awake kernel 14 1000
cd $OUT && tar czf call1.tgz *.log && rm -f *.log && echo "done at $((SECONDS-T0)) s"
