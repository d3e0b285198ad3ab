# Call A (issue 34's 48 layers beside the peer; fourteenth session): the thirteenth session's callE1.sh (llama-bench
# built and the 48-layer F16 GGUF written to /dev/shm, both under setsid) and, while they run, the optimized HLO of the
# scanned T=1 layer body, all resident against S=E through the offload path (compile only: the build's load does not
# matter to it). Carry [".peer/llama.tar.xz", ".peer/wheels"]. callB.sh right after it on the warm machine.
set -u; export PYTHONPATH=. PYTHONUNBUFFERED=1; T0=$SECONDS; D=$OUT/cA; mkdir -p $D
git log --oneline -1 | cut -c1-80
timeout 300 python3 benchmarks/results/h200-2026-12-07f-auto/scripts/body_hlo.py $D > $D/body_hlo.log 2>&1 &
bash benchmarks/results/h200-2026-12-07f-auto/scripts/callE1.sh
wait; echo "body_hlo done at $((SECONDS - T0)) s"; grep -vE "^W1|cuda_timer" $D/body_hlo.log | head -60
tar czf $OUT/cA.tgz -C $OUT cA cE1 2>/dev/null; echo "done at $((SECONDS - T0)) s"
