# Call B (issues 33 / 34), on call A's warm machine: pcie_frac=auto beside llama.cpp in one run, since auto takes the
# graphs without the pool when its choice reaches 1 and counts a split's misses from the decode's own usage after
# frozen slots (placement.following_misses). llama-bench -ncmoe 6 / 9 (50% / 25% of the expert bytes on the GPU) and
# all on the GPU, beside ours at 64 / 32 slots: auto, PCIe only (1), the host pool alone (0), then all defaults
# (drafts on, greedy); no drafts, temperature 1, spread routing, 128 tokens, 2 reps. Then (issue 38) 8 sequences at
# once against one at 32 slots (ran the tiny preset: --model was missing; callC.sh has the run) with the pool alone and auto (PCIe only ran 0.37x in the third session: the batch's
# union thrashes the slots; the pool reads each missed expert once for every row). Then, if time remains, a 1- and
# 2-expert pool job's timeline (the eleventh session's call2.sh, never run).
set -u; export PYTHONPATH=. PYTHONUNBUFFERED=1; L=/tmp/llama.cpp; T0=$SECONDS; D=$OUT/cB; mkdir -p $D
G=/dev/shm/qwen3-30b-a3b-12.gguf; WHEEL=$PWD/.peer/wheels/gguf-0.19.0-py3-none-any.whl
nvidia-smi --query-gpu=name --format=csv,noheader; git log --oneline -1 | cut -c1-80; ls -la $L/build/bin/llama-bench $G | cut -c1-150
T1="spec=0,temperature=1"
timeout 400 python3 -m benchmarks.peer_bench --layers=12 --gguf=$G --llama_bench=$L/build/bin/llama-bench \
  --gguf_py=$WHEEL --ncmoe=6,9 --embed_scale=50 --reps=2 --json=$D/peer12.json \
  --ours="expert_cache_slots=64,$T1;expert_cache_slots=32,$T1;expert_cache_slots=64,pcie_frac=1,$T1;expert_cache_slots=32,pcie_frac=1,$T1;expert_cache_slots=64,pcie_frac=0,$T1;expert_cache_slots=32,pcie_frac=0,$T1;expert_cache_slots=64;expert_cache_slots=32" \
  > $D/peer12.log 2>&1
echo "peer12 rc=$? at $((SECONDS - T0)) s"; grep -E "^\||rror|peer: -ngl|pcie_frac" $D/peer12.log | cut -c1-230 | tail -40
tar czf $OUT/cB.tgz -C $OUT cB
for pf in 0 auto 1; do
  [ $((SECONDS - T0)) -lt 480 ] || break
  timeout $((570 - (SECONDS - T0))) python3 -m benchmarks batch --layers=12 --batch=1,8 --expert_cache_slots=32 \
    --pcie_frac=$pf --new_tokens=64 > $D/batch-pcie$pf.log 2>&1
  echo "batch pcie_frac=$pf rc=$? at $((SECONDS - T0)) s"; grep -E "^\||rror|pcie_frac" $D/batch-pcie$pf.log | cut -c1-200 | tail -8
done
tar czf $OUT/cB.tgz -C $OUT cB
V="default ROWS_UP=16 ROWS_DOWN=8 TEAM_SPIN_US=1000"
for e in 1 2; do
  [ $((SECONDS - T0)) -lt 520 ] || break
  timeout 60 python3 -m host_pool.measure --threads=16 --experts=$e --formats=bf16 --windows=1 --paths=C --timeline \
    --gap-us=150 --hot-intermediate=0 --variants="$V" > $D/small-e$e.log 2>&1
  echo "experts $e rc=$? at $((SECONDS - T0)) s"; grep -E "^bf16|timeline" $D/small-e$e.log | cut -c1-200
done
tar czf $OUT/cB.tgz -C $OUT cB; echo "done at $((SECONDS - T0)) s"
