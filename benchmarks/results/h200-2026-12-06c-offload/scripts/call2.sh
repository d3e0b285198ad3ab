# Call 2 (2026-12-06, third session): the peer builds (setsid) and the 12-layer F16 GGUF is written after it, while
# the GPU tests of this session's work run (correctness only, beside the build): the batched attention kernel
# compiled against its reference and the batched engine; the GGUF types kept as read (int4-q4k, int8-g, int4-g32f/m)
# under the compiled expert kernel in the scanned offload graph, and their pool C kernels on the 16-core host; lru
# windows without the staging call under the compiled kernel.
set -u; export PYTHONPATH=. PYTHONUNBUFFERED=1 TESTS_COMPILE_GRAPHS=lazy; R=$OUT; LLAMA=/tmp/llama.cpp; T0=$SECONDS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; lscpu | grep -E "Model name"; git log --oneline -1 | cut -c1-80
pip install --no-index --no-deps -q .peer/wheels/*.whl 2>&1 | tail -1; python3 -c "import gguf, yaml; print('gguf', gguf.__file__)" 2>&1 | tail -1
setsid nohup bash benchmarks/peer/build_llama.sh "$PWD/.peer/llama.tar.xz" $LLAMA > /dev/null 2>&1 < /dev/null &
setsid nohup bash -c "while [ ! -d $LLAMA/gguf-py ]; do sleep 2; done; python3 benchmarks/peer/write_gguf.py \
  --out=/tmp/gguf.part --model=qwen3-30b-a3b --layers=12 --gguf_py=$LLAMA/gguf-py > /tmp/gguf.log 2>&1 \
  && mv /tmp/gguf.part /tmp/qwen3-30b-a3b-12.gguf; echo rc=\$? > /tmp/gguf.done" > /dev/null 2>&1 < /dev/null &
t() { local name=$1 lim=$2; shift 2; timeout $lim python3 -m pytest -q -p no:cacheprovider -o console_output_style=classic "$@" > $R/$name.log 2>&1
  echo "$name rc=$? at $((SECONDS - T0)) s: $(tail -1 $R/$name.log | cut -c1-160)"; grep -E "^(FAILED|ERROR)" $R/$name.log | cut -c1-200 | head -5; }
t batch_kernel 100 tests/kernels/test_gpu_kernels.py -k batch_decode_attention
t batch_engine 90 tests/engine/test_batch.py -k "forms_equal or greedy_batch"
t kept_kernel 120 tests/io/test_gguf_kept.py -k "under_the_kernel or logits_equal" tests/io/test_gguf_q4k.py -k "under_the_kernel or logits_equal"
t lru_staging 60 tests/model/test_quant.py -k "lru_windows or scan_offloaded"
t pool_kept 60 tests/host_pool/test_host_pool_kept.py tests/host_pool/test_host_pool_q4k.py
while { [ ! -f $LLAMA.done ] || [ ! -f /tmp/gguf.done ]; } && [ $((SECONDS - T0)) -lt 560 ]; do sleep 3; done
echo "build: $(cat $LLAMA.done 2>/dev/null || echo not done: $(tail -1 $LLAMA.log | cut -c1-80)); gguf: $(cat /tmp/gguf.done 2>/dev/null) at $((SECONDS - T0)) s"
cd $R && tar czf call2.tgz *.log 2>/dev/null && rm -f *.log; ls $R
