# Call 1 (a fresh machine): the decode window's two largest kernels tuned at the 30B shape (kernel_sweep.py: the
# bf16 expert FFN at T = 1 / 8, the stacked q/k/v and o products at T = 1 / 8, coordinate descent from the defaults);
# beside it, at nice 19 on 8 jobs, llama.cpp's build, then the F16 GGUF of 24 layers in /dev/shm (for call 2,
# chained within the warm window). The sweep's times are device-side medians of synced loops of 20 ops.
set -u; export PYTHONPATH=. PYTHONUNBUFFERED=1; T0=$SECONDS
nvidia-smi --query-gpu=name --format=csv,noheader; lscpu | grep -E "Model name|^CPU\(s\)"; git log --oneline -1 | cut -c1-80
L=/tmp/llama.cpp; G=/dev/shm/qwen3-30b-a3b-24.gguf; WHEEL=$PWD/.peer/wheels/gguf-0.19.0-py3-none-any.whl
BUILD_JOBS=8 setsid nohup nice -n 19 bash -c "bash benchmarks/peer/build_llama.sh $PWD/.peer/llama.tar.xz $L; \
  PYTHONPATH=. python3 benchmarks/peer/write_gguf.py --out=$G.part --model=qwen3-30b-a3b --layers=24 \
  --gguf_py=$WHEEL > /tmp/gguf.log 2>&1 && mv $G.part $G; echo rc=\$? > /tmp/gguf.done" > /dev/null 2>&1 < /dev/null &
S=benchmarks/results/h200-2026-12-06g-sampling/scripts
timeout 420 python3 $S/kernel_sweep.py /tmp/sweep.json > $OUT/sweep.log 2>&1
echo "sweep rc=$? at $((SECONDS - T0)) s"; cp /tmp/sweep.json $OUT/ 2>/dev/null; tail -8 $OUT/sweep.log | cut -c1-240
while { [ ! -f $L.done ] || [ ! -f /tmp/gguf.done ]; } && [ $((SECONDS - T0)) -lt 555 ]; do sleep 3; done
echo "build: $(cat $L.done 2>/dev/null || echo not done); gguf: $(cat /tmp/gguf.done 2>/dev/null || echo not done) at $((SECONDS - T0)) s"
tail -1 $L.log | cut -c1-160; ls -la /dev/shm/ | grep gguf
