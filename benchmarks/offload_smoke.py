"""A quick end-to-end offload check on a real model shape (random weights): start-up lines, a short greedy request
for a few cache sizes, the counters. Not a benchmark (see offload_bench.py); a first look on a new machine.

    python -m benchmarks.offload_smoke --layers=2
"""
from __future__ import annotations


from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "qwen3-30b-a3b", "Model preset from configs/.")
flags.DEFINE_integer("layers", 2, "Layers of the preset to keep.")
flags.DEFINE_string("slots", "all,64,16", "expert_cache_slots values to try.")
flags.DEFINE_integer("new_tokens", 24, "Tokens to generate per request.")


def main(argv):
    import numpy as np
    from strata_jax import Engine
    from strata_jax.model.config import preset
    cfg = preset(FLAGS.model, layers=FLAGS.layers)
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, 40).tolist()
    outputs = {}
    from benchmarks.runner import parse_list
    for slots in parse_list(FLAGS.slots, str, "slots"):
        eng = Engine.from_random(cfg, seed=0, expert_cache_slots=slots, context=512, window=2)
        for _ in range(2):  # the second request runs on a warm cache
            out = eng.generate(prompt, FLAGS.new_tokens, stop_token_ids=[])
        outputs[slots] = out
        print(f"slots={slots}: {eng.stats.last.summary()}")
        if eng.placement:
            print(f"  decode experts: {eng.stats.last.decode_experts.summary()}")
        del eng
    first = next(iter(outputs.values()))
    print("greedy outputs equal across cache sizes (bf16: may differ by rounding):",
          all(o == first for o in outputs.values()))


if __name__ == "__main__":
    app.run(main)
