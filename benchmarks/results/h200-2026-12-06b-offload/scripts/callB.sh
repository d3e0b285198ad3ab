# Call B (2026-12-06, second session): the peer builds (setsid) and the 12-layer F16 GGUF is written after it, while
# the plan kernel's GPU test (timed out at 120 s in call A), the other offload GPU tests and the deferral's tests
# (through the native calls in the scanned body: never run on a GPU before) run (correctness only);
# then llama.cpp and our generate loop on 12 layers of the 30B shape in one process (peer_bench, routing spread):
# default settings, PCIe only and the host pool alone at 64 / 32 of 128 slots (-ncmoe 6 / 9), and all resident
# greedy and sampled (Qwen3's 0.7 / 20 / 0.8) beside llama.cpp's greedy and its sampled llama-completion.
set -u; export PYTHONPATH=. PYTHONUNBUFFERED=1; R=$OUT; LLAMA=/tmp/llama.cpp; T0=$SECONDS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; lscpu | grep -E "Model name"
setsid nohup bash benchmarks/peer/build_llama.sh "$PWD/.peer/llama.tar.xz" $LLAMA > /dev/null 2>&1 < /dev/null &
setsid nohup bash -c "while [ ! -d $LLAMA/gguf-py ]; do sleep 2; done; python3 benchmarks/peer/write_gguf.py \
  --out=/tmp/gguf.part --model=qwen3-30b-a3b --layers=12 --gguf_py=$LLAMA/gguf-py > /tmp/gguf.log 2>&1 \
  && mv /tmp/gguf.part /tmp/qwen3-30b-a3b-12.gguf; echo rc=\$? > /tmp/gguf.done" > /dev/null 2>&1 < /dev/null &
timeout 240 python3 -m pytest -q -p no:cacheprovider -o console_output_style=classic tests/offload/test_slot_plan.py -k kernel > $R/plan_tests.log 2>&1
echo "plan kernel tests rc=$? at $((SECONDS - T0)) s"; tail -3 $R/plan_tests.log | cut -c1-200
L=$((330 - (SECONDS - T0))); TESTS_COMPILE_GRAPHS=lazy timeout $L python3 -m pytest -v -p no:cacheprovider -o console_output_style=classic \
  -k "fetch_by_the_worker or pool_failure or check_equals or defer_matches" tests/engine/test_gpu.py \
  tests/offload/test_defer.py > $R/tests.log 2>&1
echo "tests rc=$? at $((SECONDS - T0)) s"; grep -E "PASS|FAIL|ERROR|passed|failed" $R/tests.log | cut -c1-150 | tail -12
while { [ ! -f $LLAMA.done ] || [ ! -f /tmp/gguf.done ]; } && [ $((SECONDS - T0)) -lt 370 ]; do sleep 3; done
echo "build: $(cat $LLAMA.done 2>/dev/null || echo not done: $(tail -1 $LLAMA.log | cut -c1-80)); gguf: $(cat /tmp/gguf.done 2>/dev/null) at $((SECONDS - T0)) s"
T1="spec=0,temperature=1"; Q="temperature=0.7,top_k=20,top_p=0.8"
timeout $((592 - (SECONDS - T0))) python3 -m benchmarks.peer_bench --layers=12 --llama_bench=$LLAMA/build/bin/llama-bench \
  --gguf_py=$LLAMA/gguf-py --ncmoe=6,9 --embed_scale=50 --reps=2 --peer_sampling=$Q \
  --ours="expert_cache_slots=64,pcie_frac=1,$T1;expert_cache_slots=32,pcie_frac=1,$T1;expert_cache_slots=64,pcie_frac=0,$T1;expert_cache_slots=32,pcie_frac=0,$T1;expert_cache_slots=64;expert_cache_slots=32;default;$Q" \
  --json=$R/peer12.json > $R/peer12.log 2>&1
echo "peer12 rc=$? at $((SECONDS - T0)) s"; grep -E "^\||error|Error" $R/peer12.log | cut -c1-200 | tail -16
cd $R && tar czf callB.tgz *.log *.json 2>/dev/null && rm -f *.log *.json; ls $R
