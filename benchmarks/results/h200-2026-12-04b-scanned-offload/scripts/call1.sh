# Call 1: the GPU tests of offload (the scanned body the default now), then offload_bench, scanned against unrolled
# in one process (bf16, 12 layers of the 30B shape, spread routing), PCIe only.
STEPS="tests offload" TESTS_K="offload or pallas_expert or pinned" TESTS_LIMIT_S=230 OFFLOAD_FRACS=1.0,0.5,0.25 \
  OFFLOAD_PCIE=1 OFFLOAD_CALLS=auto OFFLOAD_ARGS="--layer_loops=scan,unrolled --unrolled_baseline" \
  OFFLOAD_LIMIT_S=340 bash benchmarks/gpu_speed.sh
