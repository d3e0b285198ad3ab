"""How far do the logits move with the graph (scanned / unrolled), the kernels (XLA / Pallas) and where the experts
run (resident, PCIe slots, host pool, both), and with what ran before? One tiny model, one prompt; each row's
relative distance ||a - b|| / ||b|| to the default all-resident engine, and its top-1 agreement.

    python -m benchmarks.rounding_check --dtype=bfloat16

The placement promise is float32 summation order only: 1e-5 in float32, 1e-3 in bfloat16."""
from __future__ import annotations

import tempfile

import numpy as np
from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("dtype", "bfloat16", "float32 or bfloat16.")
flags.DEFINE_integer("tokens", 25, "Prompt length scored.")
flags.DEFINE_string("cache_dir", "", "Compilation cache (default: a temporary folder).")

ARMS = [
    ("resident, scanned (default)", dict(expert_cache_slots="all")),
    ("resident, unrolled", dict(expert_cache_slots="all", layer_loop="unrolled")),
    ("resident, scanned, XLA kernels", dict(expert_cache_slots="all", expert_kernel="xla", attention_kernel="xla",
                                            dense_kernel="xla")),
    ("resident, unrolled, XLA kernels", dict(expert_cache_slots="all", layer_loop="unrolled", expert_kernel="xla",
                                             attention_kernel="xla", dense_kernel="xla")),
    ("resident, scanned, XLA expert FFN", dict(expert_cache_slots="all", expert_kernel="xla")),
    ("resident, scanned, XLA attention", dict(expert_cache_slots="all", attention_kernel="xla")),
    ("resident, scanned, XLA products", dict(expert_cache_slots="all", dense_kernel="xla")),
    ("slots 4, PCIe", dict(expert_cache_slots=4, pcie_frac=1.0)),
    ("slots 4, host pool", dict(expert_cache_slots=4, pcie_frac=0.0)),
    ("slots 4, half and half", dict(expert_cache_slots=4, pcie_frac=0.5)),
    ("slots 4, host pool, XLA kernels", dict(expert_cache_slots=4, pcie_frac=0.0, expert_kernel="xla",
                                             attention_kernel="xla", dense_kernel="xla")),
]


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def main(argv):
    del argv
    import jax
    from strata_jax import Engine
    cache_dir = FLAGS.cache_dir or tempfile.mkdtemp(prefix="strata_round_")
    tokens = np.random.default_rng(77).integers(0, 255, FLAGS.tokens).tolist()
    print(f"backend {jax.default_backend()}, dtype {FLAGS.dtype}, {FLAGS.tokens} tokens scored at window 4")
    print("| engine | kernels (expert/attention/products) | rel. to default | after 3 other requests | top-1 agree |")
    print("|---|---|--:|--:|--:|")
    ref = None
    for name, opts in ARMS:
        eng = Engine.from_pretrained(None, verbose=False, cache_dir=cache_dir, dtype=FLAGS.dtype, window=4,
                                     context=64, **opts)
        got = eng.score(tokens, window=4)
        for s in range(3):
            eng.generate(np.random.default_rng(s).integers(0, 255, 9).tolist(), 8, stop_token_ids=[])
        after = eng.score(tokens, window=4)
        ref = got if ref is None else ref
        agree = float(np.mean(np.argmax(got, -1) == np.argmax(ref, -1)))
        kernels = f"{eng.expert_kernel}/{eng.attention_kernel}/{eng.dense_kernel}"
        print(f"| {name} | {kernels} | {rel(got, ref):.1e} | {rel(after, ref):.1e} | {agree:.2f} |", flush=True)


if __name__ == "__main__":
    app.run(main)
