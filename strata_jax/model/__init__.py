"""The model, as pure functions over pytree dataclasses (nothing here knows of the engine, offload or requests).

- config.py: `ModelConfig` from a Hugging Face config.json (Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE's text model),
  the presets in configs/.
- weights.py: the weights, declared once (`weight_specs` / `layer_specs`: every leaf's shape, Hub name, layout and
  init), drawn at random, made abstract, stacked on a layer axis.
- kv_cache.py: the KV cache (bf16 / float32, or int8 rows with scales) and the DeltaNet state ring beside it.
- transformer.py: the forward pass of one window: norms, RoPE, attention, the layer loops (unrolled, scanned,
  scanned with offload), the head.
- batch.py: the batched window: B sequences a row each, each with its own position and KV slot.
- moe.py (routing, the expert FFN, the all-resident expert path), deltanet.py (Qwen3-Next's Gated DeltaNet),
  linear.py (every dense product), quant.py (the low-bit expert formats).

May import: strata_jax.errors and strata_jax.pallas_kernels. This package's __init__ imports nothing, so
`strata_jax.model.config` stays light (the command line reads presets before JAX is imported).
"""
