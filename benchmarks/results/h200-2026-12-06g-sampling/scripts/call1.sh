# Call 1 (seventh session, a fresh machine; the sixth session's prepared call 4): where the server's 8-client streams
# lose against batch_bench's windows, and whether the host pool serves an offloaded batch. (a) batch_bench in process, B = 1 / 8 / 16, all resident; (b) the
# server, all resident, 1 / 8 / 16 clients of one request each (128 + 256 tokens: the streams after every newcomer
# has joined, fewer admissions between windows); (c) the server with 25% of the experts in slots, pcie_frac=auto
# (the pool takes a share of each window's misses, read once for every row) against the sixth session's PCIe only.
# Beside it, at nice 19 on 8 jobs (for call 2, chained within the warm window): llama.cpp's build, then the F16 GGUF
# of 24 layers of the 30B shape in /dev/shm. The serve figures share the host with that build: read them as ratios.
set -u; export PYTHONUNBUFFERED=1; T0=$SECONDS
nvidia-smi --query-gpu=name --format=csv,noheader; lscpu | grep -E "Model name|^CPU\(s\)"; git log --oneline -1 | cut -c1-80
L=/tmp/llama.cpp; G=/dev/shm/qwen3-30b-a3b-24.gguf; WHEEL=$PWD/.peer/wheels/gguf-0.19.0-py3-none-any.whl
BUILD_JOBS=8 setsid nohup nice -n 19 bash -c "bash benchmarks/peer/build_llama.sh $PWD/.peer/llama.tar.xz $L; \
  PYTHONPATH=. python3 benchmarks/peer/write_gguf.py --out=$G.part --model=qwen3-30b-a3b --layers=24 \
  --gguf_py=$WHEEL > /tmp/gguf.log 2>&1 && mv $G.part $G; echo rc=\$? > /tmp/gguf.done" > /dev/null 2>&1 < /dev/null &
python3 -m pip install -q --no-index --find-links .peer/wheels/serve --target /tmp/serve-site fastapi uvicorn \
  sse-starlette openai > /tmp/pip.log 2>&1; echo "pip rc=$? at $((SECONDS - T0)) s"
export PYTHONPATH=.:/tmp/serve-site
timeout 120 python3 -m benchmarks.batch_bench --model=qwen3-30b-a3b --layers=12 --batch=1,8,16 --prompt=128 \
  --new_tokens=128 > $OUT/batch.log 2>&1
echo "batch rc=$? at $((SECONDS - T0)) s"; grep -E "^\||rror" $OUT/batch.log | cut -c1-200 | tail -8
timeout 150 python3 -m benchmarks.serve_bench --model=qwen3-30b-a3b --layers=12 --clients=1,8,16 --requests=1 \
  --prompt=128 --new_tokens=256 --expert_cache_slots=all --json=$OUT/serve-long.json > $OUT/serve-long.log 2>&1
echo "serve long rc=$? at $((SECONDS - T0)) s"; grep -E "^\||rror" $OUT/serve-long.log | cut -c1-200 | tail -6
timeout $((450 - (SECONDS - T0))) python3 -m benchmarks.serve_bench --model=qwen3-30b-a3b --layers=12 --clients=1,8 \
  --requests=1 --prompt=128 --new_tokens=64 --expert_cache_slots=25% --pcie_frac=auto \
  --json=$OUT/serve-auto.json > $OUT/serve-auto.log 2>&1
echo "serve auto rc=$? at $((SECONDS - T0)) s"; grep -E "^\||rror|pcie_frac" $OUT/serve-auto.log | cut -c1-200 | tail -6
echo "build: $(cat $L.done 2>/dev/null || echo not done); gguf: $(cat /tmp/gguf.done 2>/dev/null || echo not done) at $((SECONDS - T0)) s"
cd $OUT && tar czf call1.tgz *.log *.json 2>/dev/null; ls $OUT
