# Call 3 (same warm machine as call 2, llama.cpp built there): llama.cpp and our generate loop on 12 layers of the
# 30B shape in one process (peer_bench, routing spread): PCIe only, the host pool alone (its kept thread team and
# job-sized blocks) and pcie_frac=auto (its in-graph cost model) at 64 / 32 of 128 slots (-ncmoe 6 / 9), no drafts,
# temperature 1; default settings at both; all resident greedy default and Qwen3's sampling (0.7 / 20 / 0.8) with
# default settings and spec=0, beside llama.cpp's greedy and its sampled llama-completion.
set -u; export PYTHONPATH=. PYTHONUNBUFFERED=1; R=$OUT; LLAMA=/tmp/llama.cpp; T0=$SECONDS
nvidia-smi --query-gpu=name --format=csv,noheader; cat $LLAMA.done /tmp/gguf.done 2>&1 | tr '\n' ' '; echo
T1="spec=0,temperature=1"; Q="temperature=0.7,top_k=20,top_p=0.8"
timeout 585 python3 -m benchmarks.peer_bench --layers=12 --llama_bench=$LLAMA/build/bin/llama-bench \
  --gguf_py=$LLAMA/gguf-py --ncmoe=6,9 --embed_scale=50 --reps=2 --peer_sampling=$Q \
  --ours="expert_cache_slots=64,pcie_frac=1,$T1;expert_cache_slots=32,pcie_frac=1,$T1;expert_cache_slots=64,pcie_frac=0,$T1;expert_cache_slots=32,pcie_frac=0,$T1;expert_cache_slots=64,$T1;expert_cache_slots=32,$T1;expert_cache_slots=64;expert_cache_slots=32;default;$Q;$Q,spec=0" \
  --json=$R/peer12.json > $R/peer12.log 2>&1
echo "peer12 rc=$? at $((SECONDS - T0)) s"; grep -E "^\||error|Error|pcie_frac: " $R/peer12.log | cut -c1-240 | tail -30
cd $R && tar czf call3.tgz *.log *.json 2>/dev/null && rm -f *.json; ls $R
