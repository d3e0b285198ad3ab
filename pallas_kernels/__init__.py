"""Pallas kernels, one file per kernel, ordered kernel, jitted wrapper (with an `interpret=` argument), then
`<op>_reference` in plain jnp. Each has a test comparing it with its reference in interpret mode on the CPU and a
test that lowers it for CUDA without a GPU. None is in use yet: the engine's exact path runs on XLA ops."""
