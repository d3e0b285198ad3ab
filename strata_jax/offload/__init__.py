"""Expert placement, one wing: where a sparse layer's routed experts live and run when they do not all fit on the
device.

- slots.py: the in-graph side. The device expert cache (SlotCache: S slots per layer), the window's plan
  (resident / fetch / cpu / skip), the one PCIe copy loop (copy_experts), the static policy's fill and the
  offloaded expert path (OffloadedExperts) that the model's layers call.
- placement.py: the start-up side. How many slots fit, the experts' host copies (HostExperts), the host pool, the
  cost model behind pcie_frac=auto, and the one rule for pcie_frac (needs_cpu_path: when a change recompiles).
- approx.py: the routing approximations (STRATA_ROUTE_*) and their switch parsing.
- defer.py: the deferred CPU rows (STRATA_VERIFY_DEFER_CPU*) and their switch parsing.

What it may touch: strata_jax.model, errors, options (the option tables and the env helpers), host_pool and
pallas_kernels. The engine imports this wing, never the reverse; nothing here imports strata_jax.engine.
"""
