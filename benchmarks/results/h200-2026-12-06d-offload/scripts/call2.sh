# Call 2 (same warm machine as call 1, llama.cpp built there): llama.cpp and our generate loop on 12 layers of the
# 30B shape in one process (peer_bench, routing spread), with the signal kernels: PCIe only, the host pool alone and
# pcie_frac=auto at 64 / 32 of 128 slots (-ncmoe 6 / 9), no drafts, temperature 1; default settings at both.
set -u; export PYTHONPATH=. PYTHONUNBUFFERED=1; R=$OUT; LLAMA=/tmp/llama.cpp; T0=$SECONDS
nvidia-smi --query-gpu=name --format=csv,noheader; cat $LLAMA.done /tmp/gguf.done 2>&1 | tr '\n' ' '; echo
while { [ ! -f $LLAMA.done ] || [ ! -f /tmp/gguf.done ]; } && [ $((SECONDS - T0)) -lt 200 ]; do sleep 3; done
T1="spec=0,temperature=1"
timeout 540 python3 -m benchmarks.peer_bench --layers=12 --llama_bench=$LLAMA/build/bin/llama-bench \
  --gguf_py=$LLAMA/gguf-py --ncmoe=6,9 --embed_scale=50 --reps=2 \
  --ours="expert_cache_slots=64,pcie_frac=1,$T1;expert_cache_slots=32,pcie_frac=1,$T1;expert_cache_slots=64,pcie_frac=0,$T1;expert_cache_slots=32,pcie_frac=0,$T1;expert_cache_slots=64,$T1;expert_cache_slots=32,$T1;expert_cache_slots=64;expert_cache_slots=32" \
  --json=$R/peer12.json > $R/peer12.log 2>&1
echo "peer12 rc=$? at $((SECONDS - T0)) s"; grep -E "^\||error|Error|pcie_frac: | ours \[| peer: " $R/peer12.log | cut -c1-240 | tail -30
cd $R && tar czf call2.tgz *.log *.json 2>/dev/null && rm -f *.json; ls $R
