# Call 1 (a fresh machine; device time short after refused starts: one call does what two were planned for):
# (a) at nice 19, llama.cpp's build (16 jobs) and, beside it, the F16 GGUF of 24 layers of the 30B shape in /dev/shm;
# (b) meanwhile the decode window's two largest kernels tuned at the 30B shape (kernel_sweep.py, SWEEP_S seconds:
#     the bf16 expert FFN and the stacked q/k/v and o products at T = 1 / 8, coordinate descent from the defaults;
#     device-side medians of synced loops of 20 ops; the build shares the host's cores);
# (c) issue 39's row at 24 layers, all resident, one process: our generate loop greedy and with Qwen3's sampling
#     (0.7 / top_k 20 / top_p 0.8), default settings, beside llama.cpp's greedy tg128 and its sampled
#     llama-completion; (d) the same two arms with the sweep's tuning in place of the kernels' defaults (tuned_run.py).
set -u; export PYTHONPATH=.:$PWD/.peer/wheels/gguf-0.19.0-py3-none-any.whl PYTHONUNBUFFERED=1; T0=$SECONDS
nvidia-smi --query-gpu=name --format=csv,noheader; lscpu | grep -E "Model name|^CPU\(s\)"; git log --oneline -1 | cut -c1-80
L=/tmp/llama.cpp; G=/dev/shm/qwen3-30b-a3b-24.gguf; WHEEL=$PWD/.peer/wheels/gguf-0.19.0-py3-none-any.whl
Q="temperature=0.7,top_k=20,top_p=0.8"; S=benchmarks/results/h200-2026-12-06g-sampling/scripts
BUILD_JOBS=16 setsid nohup nice -n 19 bash benchmarks/peer/build_llama.sh $PWD/.peer/llama.tar.xz $L > /dev/null 2>&1 < /dev/null &
setsid nohup nice -n 10 bash -c "PYTHONPATH=. python3 benchmarks/peer/write_gguf.py --out=$G.part --model=qwen3-30b-a3b \
  --layers=24 --gguf_py=$WHEEL > /tmp/gguf.log 2>&1 && mv $G.part $G; echo rc=\$? > /tmp/gguf.done" > /dev/null 2>&1 < /dev/null &
SWEEP_S=${SWEEP_S:-200} timeout 255 python3 $S/kernel_sweep.py /tmp/sweep.json > $OUT/sweep.log 2>&1
echo "sweep rc=$? at $((SECONDS - T0)) s"; cp /tmp/sweep.json $OUT/ 2>/dev/null; tail -7 $OUT/sweep.log | cut -c1-240
while { [ ! -f $L.done ] || [ ! -f /tmp/gguf.done ]; } && [ $((SECONDS - T0)) -lt 330 ]; do sleep 3; done
echo "build: $(cat $L.done 2>/dev/null || echo not done); gguf: $(cat /tmp/gguf.done 2>/dev/null || echo not done) at $((SECONDS - T0)) s"
tail -1 $L.log | cut -c1-160; ls -la /dev/shm/ | grep gguf
LB=$L/build/bin/llama-bench; [ -x $LB ] && [ -f $G ] || LB=
timeout $((495 - (SECONDS - T0))) python3 -m benchmarks.peer_bench --layers=24 --gguf=$G --llama_bench=$LB \
  --gguf_py=$WHEEL --reps=3 --peer_sampling=$Q --ours="default;$Q" --json=$OUT/peer24.json > $OUT/peer24.log 2>&1
echo "peer24 rc=$? at $((SECONDS - T0)) s"; grep -E "^\||rror" $OUT/peer24.log | cut -c1-240 | tail -10
timeout $((588 - (SECONDS - T0))) python3 $S/tuned_run.py /tmp/sweep.json benchmarks.peer_bench --layers=24 \
  --llama_bench= --reps=3 --ours="default;$Q" --json=$OUT/peer24-tuned.json > $OUT/peer24-tuned.log 2>&1
echo "tuned rc=$? at $((SECONDS - T0)) s"; grep -E "^\||rror|tuned kernels|ours \[" $OUT/peer24-tuned.log | cut -c1-240 | tail -8
cd $OUT && tar czf call1.tgz *.log *.json 2>/dev/null; ls $OUT
