"""What the engine reads and writes besides tensors in flight: checkpoints (safetensors in, orbax state out and
in), GGUF files (gguf_file.py), the embedded models (assets/), tokenizers, chat templates and generation configs,
the log-prob files.

May import the model (its weight declaration drives the loaders) and strata_jax.errors, never the engine.
"""
