# Call 2 (a fresh machine): llama.cpp's build (12 jobs) and the 12-layer F16 GGUF under setsid, beside the GPU tests
# of the packed K forms (nothing timed): int6-q6k (Q6_K, Q3_K) and int6-q6km (a family of mixed K types) under the
# compiled expert kernel in the scanned offload graph, the int4-q4k/int6-q6k and int4-q4k/int6-q6km pairs, the
# llama.cpp-quantized fixtures (weights, logits resident and offloaded, tokens), the pool's C kernels of both forms on
# this host's CPU; then llama-quantize makes Q4_K_M and Q2_K (setsid, for call 3).
set -u; export PYTHONPATH=.:$PWD/.peer/wheels/gguf-0.19.0-py3-none-any.whl PYTHONUNBUFFERED=1; L=/tmp/llama.cpp; T0=$SECONDS
G=/dev/shm/qwen3-30b-a3b-12.gguf; WHEEL=$PWD/.peer/wheels/gguf-0.19.0-py3-none-any.whl
nvidia-smi --query-gpu=name --format=csv,noheader; lscpu | grep -E "Model name|^CPU\(s\)|Thread\(s\) per core"
git log --oneline -1 | cut -c1-80
BUILD_JOBS=12 setsid nohup bash benchmarks/peer/build_llama.sh "$PWD/.peer/llama.tar.xz" $L > /dev/null 2>&1 < /dev/null &
setsid nohup bash -c "python3 benchmarks/peer/write_gguf.py --out=$G.part --model=qwen3-30b-a3b --layers=12 \
  --gguf_py=$WHEEL > /tmp/gguf.log 2>&1 && mv $G.part $G; echo rc=\$? > /tmp/gguf.done" > /dev/null 2>&1 < /dev/null &
timeout 400 python3 -m pytest -q -p no:cacheprovider -o console_output_style=classic \
  tests/io/test_gguf_q6k.py tests/io/test_gguf_mixed.py tests/io/test_gguf_q6km.py tests/io/test_gguf_llama.py \
  tests/host_pool/test_host_pool_q6k.py tests/host_pool/test_host_pool_q6km.py > $OUT/tests.log 2>&1
echo "tests rc=$? at $((SECONDS - T0)) s: $(tail -1 $OUT/tests.log | cut -c1-160)"
grep -E "^(FAILED|ERROR)|Error" $OUT/tests.log | head -8 | cut -c1-200
while { [ ! -f $L.done ] || [ ! -f /tmp/gguf.done ]; } && [ $((SECONDS - T0)) -lt 480 ]; do sleep 3; done
echo "build: $(cat $L.done 2>/dev/null || echo not done); gguf: $(cat /tmp/gguf.done 2>/dev/null || echo not done) at $((SECONDS - T0)) s"
tail -2 $L.log | cut -c1-200; ls -la /dev/shm/ | grep gguf
setsid nohup bash -c "for t in Q4_K_M Q2_K; do s=\$SECONDS; $L/build/bin/llama-quantize $G /dev/shm/qwen3-30b-a3b-12-\$t.gguf.part \$t \
  > /tmp/quant-\$t.log 2>&1 && mv /dev/shm/qwen3-30b-a3b-12-\$t.gguf.part /dev/shm/qwen3-30b-a3b-12-\$t.gguf; \
  echo \"\$t rc=\$? in \$((SECONDS-s)) s\" >> /tmp/quant.done; done" > /dev/null 2>&1 < /dev/null &
echo "quantize started at $((SECONDS - T0)) s"
