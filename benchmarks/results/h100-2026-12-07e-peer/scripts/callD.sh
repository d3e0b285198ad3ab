# Call D (issues 33 / 34): pcie_frac=auto takes the graphs without the host pool when its choice crosses 1 (call B:
# auto at 64 slots ran its reps at 0.25 and at 1 inside the pool's graphs, 243.1 / 225.5 tok/s, where pcie_frac=1's
# own graphs ran 250.2). The offload GPU tests of placement and auto (exact on the GPU, the swap included), then
# ours alone (no peer: call B has llama.cpp's rows) at 64 / 32 slots: auto against pcie_frac=1 in one process, the
# same 128 tokens, 2 reps, spread routing, spec=0, temperature 1.
set -u; export PYTHONPATH=. PYTHONUNBUFFERED=1; T0=$SECONDS; D=$OUT/cD; mkdir -p $D
nvidia-smi --query-gpu=name --format=csv,noheader; lscpu | grep -E "Model name"; git log --oneline -1 | cut -c1-80
timeout 200 python3 -m pytest -q -p no:cacheprovider -o console_output_style=classic tests/offload/test_offload.py \
  -k "placement or auto" > $D/gpu-tests.log 2>&1
echo "gpu tests rc=$? at $((SECONDS - T0)) s"; tail -3 $D/gpu-tests.log | cut -c1-200; grep -E "^FAILED|^E " $D/gpu-tests.log | head -8 | cut -c1-200
tar czf $OUT/cD.tgz -C $OUT cD
T1="spec=0,temperature=1"
timeout $((560 - (SECONDS - T0))) python3 -m benchmarks.peer_bench --layers=12 --llama_bench= --embed_scale=50 --reps=2 \
  --json=$D/auto.json --ours="expert_cache_slots=64,$T1;expert_cache_slots=64,pcie_frac=1,$T1;expert_cache_slots=32,$T1;expert_cache_slots=32,pcie_frac=1,$T1" \
  > $D/auto.log 2>&1
echo "auto rc=$? at $((SECONDS - T0)) s"; grep -E "^\[.*tok/s|pcie_frac: .* ->|rror" $D/auto.log | cut -c1-300
tar czf $OUT/cD.tgz -C $OUT cD
