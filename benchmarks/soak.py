"""A soak: many sequential mixed requests on one engine, with outputs reproducible and memory flat.

    python -m benchmarks.soak --requests=200                 # the embedded model on a CPU: a few minutes

One question: after hundreds of requests of every kind (greedy and sampled, drafts from the host, from the device
or none, the host pool's share of the misses changed between requests), does each request still give the tokens it
gave the first time, and does the process's memory stay where it was?

The requests cycle through a fixed set of kinds; each kind's first answer is its reference, and every later
request of that kind must equal it. Memory: the resident set size (RSS) of the process and the device's bytes in
use, after a warm-up cycle and at the end; growth beyond --max_growth_mib fails.
"""
from __future__ import annotations

import resource
import sys
import time

from absl import flags

from benchmarks import common, runner

FLAGS = flags.FlagValues()
flags.DEFINE_string("model", "embedded", "Model: embedded, reference, or a folder.", flag_values=FLAGS)
flags.DEFINE_integer("requests", 200, "Requests in all.", lower_bound=1, flag_values=FLAGS)
flags.DEFINE_integer("new_tokens", 12, "Tokens generated per request.", lower_bound=1, flag_values=FLAGS)
flags.DEFINE_integer("max_growth_mib", 64, "Largest RSS growth allowed after the warm-up cycle.", lower_bound=0,
                     flag_values=FLAGS)
flags.DEFINE_string("cache_dir", "", "Engine cache_dir ('' = the default).", flag_values=FLAGS)
flags.DEFINE_string("json", "", "Write the numbers to this JSON file.", flag_values=FLAGS)
runner.define_output_flag(FLAGS)

# (name, pcie_frac set before the request, generate() keywords). The shares stay below 1: a move to or from 1
# recompiles (it adds or removes the host pool's callback), which is not what a soak is about.
KINDS = (
    ("greedy, drafts", 0.75, dict()),
    ("greedy, no drafts", 0.5, dict(spec=0)),
    ("sampled, drafts", 0.0, dict(temperature=0.8, top_p=0.9, seed=3)),
    ("greedy, device drafts", 0.75, dict(draft="device")),
    ("sampled, no drafts", 0.5, dict(temperature=1.0, top_k=20, seed=5, spec=0)),
)


def rss_mib() -> float:
    """The process's current resident set size (Linux /proc), else its peak (getrusage)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        import os
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run(s) -> dict:
    import numpy as np
    from strata_jax import Engine
    opts = dict(dtype="float32", window=4, context=256, expert_cache_slots=4, pcie_frac=0.5)
    if s.cache_dir:
        opts["cache_dir"] = s.cache_dir
    common.progress(f"soak: {s.model}, {s.requests} requests of {len(KINDS)} kinds, {s.new_tokens} tokens each")
    engine = Engine.from_pretrained(None if s.model == "embedded" else s.model, verbose=False, **opts)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, engine.cfg.vocab_size - 1, size=int(n)).tolist() for n in rng.integers(5, 40, 7)]
    reference: dict[tuple[int, int], list[int]] = {}
    mismatches, rows = [], []
    warm_rss = warm_dev = None
    t0 = time.perf_counter()
    for i in range(s.requests):
        k, p = i % len(KINDS), (i // len(KINDS)) % len(prompts)
        name, frac, kw = KINDS[k]
        engine.reconfigure(pcie_frac=frac)  # the expert cache starts empty: each answer is reproducible
        out = engine.generate(prompts[p], s.new_tokens, stop_token_ids=[], **kw)
        key = (k, p)
        if key not in reference:
            reference[key] = out
        elif out != reference[key]:
            mismatches.append(dict(request=i, kind=name, prompt=p))
        if i + 1 == len(KINDS) * len(prompts):  # every (kind, prompt) seen once: the warm-up is over
            warm_rss, warm_dev = rss_mib(), common.device_memory_in_use()
        if (i + 1) % 25 == 0 or i + 1 == s.requests:
            rows.append([i + 1, rss_mib(), (common.device_memory_in_use() or 0) / 2**20, len(mismatches),
                         time.perf_counter() - t0])
            common.progress(f"soak: {i + 1}/{s.requests} requests, RSS {rows[-1][1]:.0f} MiB, "
                            f"{len(mismatches)} mismatches")
    end_rss, end_dev = rss_mib(), common.device_memory_in_use()
    growth = (end_rss - warm_rss) if warm_rss is not None else 0.0
    table = runner.table(s, "soak", ["requests", "RSS MiB", "device MiB in use", "mismatches", "seconds"], rows,
                         params=["requests"], timing="wall seconds since the first request")
    ok = not mismatches and growth <= s.max_growth_mib
    common.say(f"soak: {s.requests} requests, {len(mismatches)} answers differing from their kind's first; RSS "
               f"growth after the warm-up {growth:+.1f} MiB (limit {s.max_growth_mib}); "
               f"{'ok' if ok else 'FAILED'}")
    result = dict(benchmark="soak", settings={n: getattr(s, n) for n in FLAGS}, mismatches=mismatches,
                  rss_warm_mib=warm_rss, rss_end_mib=end_rss, rss_growth_mib=growth, device_warm=warm_dev,
                  device_end=end_dev, table=table, ok=ok)
    if s.json:
        common.write_json(s.json, result)
    if not ok:
        from strata_jax.errors import StrataError
        raise StrataError(f"soak failed: {len(mismatches)} mismatches, RSS growth {growth:+.1f} MiB")
    return result


def main(argv: list[str]) -> dict:
    return common.run_main(FLAGS, argv, "benchmarks.soak", run)


if __name__ == "__main__":
    main(sys.argv)
