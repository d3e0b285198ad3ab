# Call A (issues 33 / 34): the twelfth session's call A again, as run (same text): llama-bench built under setsid and
# the 12-layer F16 GGUF written to /dev/shm for call B; meanwhile the offload GPU tests. Carry
# [".peer/llama.tar.xz", ".peer/wheels/gguf-0.19.0-py3-none-any.whl"].
exec bash benchmarks/results/h100-2026-12-07e-peer/scripts/callA.sh
