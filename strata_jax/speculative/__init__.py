"""Drafting for verify windows: where the T-1 drafts of a window come from.

- drafters.py: the host `Drafter` interface, prompt lookup (`NgramDrafter`), `NoDrafter`, the draft gate.
- device_drafts.py: `draft=device`, the n-gram rule and the acceptance as device code.
- mtp.py: `draft=mtp`, Qwen3-Next's multi-token-prediction module, its weights, cache and draft graphs.

The acceptance rules themselves (greedy, rejection sampling) are in strata_jax/sampling.py; the window graphs that
draft, verify and accept in one call in strata_jax/engine/graphs.py. May import the model and sampling, never the
engine.
"""
