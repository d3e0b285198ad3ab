# Call 2 (chained on call 1's warm machine): issue 39's row at 24 layers with the sweep's picks (TUNING=path of call
# 1's sweep.json, carried in the tree, or /tmp/strata-sweep.json where call 1 left it on the same warm machine;
# empty: the kernels' defaults). (a) At nice 19 llama.cpp's build and the F16
# GGUF of 24 layers in /dev/shm; beside them the GPU tests of the GEMV reductions and of the scanned engine with the
# picks (exact against the unrolled XLA graph). (b) peer_bench, one process: llama-bench tg128 and llama-completion
# with Qwen3's sampling beside our greedy default, greedy spec=0 and sampled default (the first arm once untimed).
set -u; export PYTHONPATH=.:$PWD/.peer/wheels/gguf-0.19.0-py3-none-any.whl PYTHONUNBUFFERED=1; T0=$SECONDS
pack() { tar czf $OUT/c2.tgz -C $OUT c2; }  # after each step: a call cut by its limit still brings back what it did
D=$OUT/c2; mkdir -p $D; TUNING=${TUNING:-}
[ -n "$TUNING" ] && case $TUNING in /*) export STRATA_KERNEL_TUNING=$TUNING;; *) export STRATA_KERNEL_TUNING=$PWD/$TUNING;; esac
nvidia-smi --query-gpu=name --format=csv,noheader; git log --oneline -1 | cut -c1-80; echo "tuning: ${TUNING:-defaults}"
L=/tmp/llama.cpp; G=/dev/shm/qwen3-30b-a3b-24.gguf; WHEEL=$PWD/.peer/wheels/gguf-0.19.0-py3-none-any.whl
Q="temperature=0.7,top_k=20,top_p=0.8"
BUILD_JOBS=16 setsid nohup nice -n 19 bash benchmarks/peer/build_llama.sh $PWD/.peer/llama.tar.xz $L > /dev/null 2>&1 < /dev/null &
setsid nohup nice -n 10 bash -c "PYTHONPATH=. python3 benchmarks/peer/write_gguf.py --out=$G.part --model=qwen3-30b-a3b \
  --layers=24 --gguf_py=$WHEEL > /tmp/gguf.log 2>&1 && mv $G.part $G; echo rc=\$? > /tmp/gguf.done" > /dev/null 2>&1 < /dev/null &
timeout 230 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gpu_kernels.py -k "gemv or stacked or expert_ffn" \
  tests/engine/test_gpu.py -k "gemv or stacked or expert_ffn or scanned_layers" > $D/gpu-tests.log 2>&1
echo "gpu tests rc=$? at $((SECONDS - T0)) s"; tail -3 $D/gpu-tests.log | cut -c1-200; pack
while { [ ! -f $L.done ] || [ ! -f /tmp/gguf.done ]; } && [ $((SECONDS - T0)) -lt 330 ]; do sleep 3; done
echo "build: $(cat $L.done 2>/dev/null || echo not done); gguf: $(cat /tmp/gguf.done 2>/dev/null || echo not done) at $((SECONDS - T0)) s"
LB=$L/build/bin/llama-bench; [ -x $LB ] && [ -f $G ] || LB=
timeout $((585 - (SECONDS - T0))) python3 -m benchmarks.peer_bench --layers=24 --gguf=$G --llama_bench=$LB \
  --gguf_py=$WHEEL --reps=3 --peer_sampling=$Q --ours="default;spec=0;$Q" --json=$D/peer24.json > $D/peer24.log 2>&1
echo "peer24 rc=$? at $((SECONDS - T0)) s"; grep -E "^\||rror|kernel tuning" $D/peer24.log | cut -c1-240 | tail -12; pack
tar czf $OUT/c2.tgz -C $OUT c2; echo "done at $((SECONDS - T0)) s"
