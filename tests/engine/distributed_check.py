"""The equality check of parallel=experts over several processes (jax.distributed), run as one of them:

    JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=N \\
        python tests/engine/distributed_check.py PROCESS_ID NUM_PROCESSES COORDINATOR_PORT

Every process runs this same script: it joins the others (gloo collectives on the CPU), builds the tiny config's
random float32 engine over every process's devices (devices=all, parallel=experts) and, beside it, the single-device
engine on its own first device, and prints one JSON line: prefill logits, teacher-forced decode windows of T=1 and
T=4 (relative errors) and greedy `generate` (T=1 windows, verify windows with n-gram drafts) against one device.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from strata_jax.model.config import preset  # noqa: E402
from strata_jax.engine.api import Engine  # noqa: E402

OPTS = dict(dtype="float32", expert_cache_slots="all", window=4, context=64, prefill_chunk=16, verbose=False,
            compile_graphs="lazy")  # each graph on its first use: the check runs T = 1 and 4, not T = 2 and 3


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))


def outputs(eng: Engine, prompt: list[int], text: list[int]) -> dict:
    return dict(prefill=eng.prefill_logits(prompt), w1=eng.score(text, window=1), w4=eng.score(text, window=4),
                gen1=eng.generate(text, max_new_tokens=10, draft="none"),
                gen4=eng.generate(text, max_new_tokens=10, draft="ngram"))


def main(process_id: int, num_processes: int, port: int) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU collectives across processes
    jax.distributed.initialize(f"localhost:{port}", num_processes, process_id)
    cfg = preset("tiny")
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 256, 21).tolist()  # two prefill chunks (16 + 5)
    # repeats: the n-gram drafter proposes, windows of T = 4 run; 28 tokens, whole windows of 4 for score (as
    # parallel_check.py: 30 ran a last window of 2, a graph per engine more)
    text = (prompt * 2)[:28]
    ref = outputs(Engine.from_random(cfg, seed=3, **OPTS), prompt, text)  # one device: this process's first
    eng = Engine.from_random(cfg, seed=3, devices="all", parallel="experts", **OPTS)
    got = outputs(eng, prompt, text)
    out = {"process": jax.process_index(), "devices": len(jax.devices()), "local": len(jax.local_devices()),
           "line": eng.parallel.line}
    for k in ("prefill", "w1", "w4"):
        out[k] = rel(got[k], ref[k])
    for k in ("gen1", "gen4"):
        out[k] = got[k] == ref[k]
    out["tokens"] = got["gen4"]
    print(json.dumps(out), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:4]))
