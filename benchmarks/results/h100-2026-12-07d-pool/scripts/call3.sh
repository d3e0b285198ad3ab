# Call 3 (issues 33 / 34): our generate loop beside llama.cpp in one run after the fill change (the slots filled from
# the prefill copy only what changed and are not decode time). llama-bench alone is built (setsid) while the
# 12-layer F16 GGUF is written to /dev/shm; then peer_bench: -ncmoe 6 / 9 (50% / 25% of the expert bytes on the GPU)
# beside ours at 64 / 32 slots, the host pool alone (pcie_frac=0), PCIe only (1) and the default split (auto), no
# drafts, temperature 1, spread routing; the first arm once untimed.
set -u; export PYTHONPATH=. PYTHONUNBUFFERED=1; L=/tmp/llama.cpp; T0=$SECONDS; D=$OUT/c3; mkdir -p $D
G=/dev/shm/qwen3-30b-a3b-12.gguf; WHEEL=$PWD/.peer/wheels/gguf-0.19.0-py3-none-any.whl
nvidia-smi --query-gpu=name --format=csv,noheader; lscpu | grep -E "Model name"; git log --oneline -1 | cut -c1-80
BUILD_TARGETS=llama-bench setsid nohup bash benchmarks/peer/build_llama.sh "$PWD/.peer/llama.tar.xz" $L > /dev/null 2>&1 < /dev/null &
setsid nohup bash -c "python3 benchmarks/peer/write_gguf.py --out=$G.part --model=qwen3-30b-a3b --layers=12 \
  --gguf_py=$WHEEL > /tmp/gguf.log 2>&1 && mv $G.part $G; echo rc=\$? > /tmp/gguf.done" > /dev/null 2>&1 < /dev/null &
while { [ ! -f $L.done ] || [ ! -f /tmp/gguf.done ]; } && [ $((SECONDS - T0)) -lt 360 ]; do sleep 3; done
echo "build: $(cat $L.done 2>/dev/null || echo not done); gguf: $(cat /tmp/gguf.done 2>/dev/null || echo not done) at $((SECONDS - T0)) s"
T1="spec=0,temperature=1"
timeout $((590 - (SECONDS - T0))) python3 -m benchmarks.peer_bench --layers=12 --gguf=$G --llama_bench=$L/build/bin/llama-bench \
  --gguf_py=$WHEEL --ncmoe=6,9 --embed_scale=50 --reps=2 --json=$D/peer12.json \
  --ours="expert_cache_slots=64,pcie_frac=0,$T1;expert_cache_slots=32,pcie_frac=0,$T1;expert_cache_slots=64,pcie_frac=1,$T1;expert_cache_slots=32,pcie_frac=1,$T1;expert_cache_slots=64,$T1;expert_cache_slots=32,$T1" \
  > $D/peer12.log 2>&1
echo "peer12 rc=$? at $((SECONDS - T0)) s"; grep -E "^\||rror|peer: -ngl| ours \[" $D/peer12.log | cut -c1-220 | tail -24
tar czf $OUT/c3.tgz -C $OUT c3
