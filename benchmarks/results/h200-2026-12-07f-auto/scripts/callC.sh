# Call C (issue 38), right after call B on the same warm machine: call B's batch step ran the tiny preset (its
# --model flag was missing); here 8 sequences at once against one alone, 12 layers of the 30B shape, spread routing
# (batch_bench's default embed_scale 50), 32 of 128 slots, the pool alone / auto / PCIe only, 64 greedy tokens.
export PYTHONPATH=. PYTHONUNBUFFERED=1; mkdir -p $OUT/cC; for pf in 0 auto 1; do timeout 170 python3 -m benchmarks batch --model=qwen3-30b-a3b --layers=12 --batch=1,8 --expert_cache_slots=32 --pcie_frac=$pf --new_tokens=64 > $OUT/cC/batch-pcie$pf.log 2>&1; echo "pf=$pf rc=$?"; grep -E "^\||rror|pcie_frac|built" $OUT/cC/batch-pcie$pf.log | cut -c1-200 | tail -9; done
