"""Pallas kernels, one file per kernel, ordered kernel, jitted wrapper (with an `interpret=` argument), then
`<op>_reference` in plain jnp. Each has a test comparing it with its reference in interpret mode on the CPU and a
test that lowers it for CUDA without a GPU. The engine runs the expert FFN, decode attention, stacked attention
products and delta rule kernels by default on a GPU in bf16 (`expert_kernel` etc. = auto; XLA elsewhere), and the
route prior and weighted row copies whenever those approximations are on (interpret mode off the GPU)."""
