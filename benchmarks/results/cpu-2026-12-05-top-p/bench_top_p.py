"""One filtered sample, "sorted" (argsort of the vocabulary) against "top_p" (threshold by bisection), jitted.

    python benchmarks/results/cpu-2026-12-05-top-p/bench_top_p.py [--vocab 151936] [--rows 1 4] [--repeats 30]

Prints a markdown table of the median time per form and row count T of sampling.sample (filter then draw) and
of sampling.filter_rows alone.
"""
from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from strata_jax import sampling  # noqa: E402
from strata_jax.sampling import SamplingParams  # noqa: E402


def median_seconds(fn, *args, repeats: int) -> float:
    fn(*args).block_until_ready()  # compile
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*args).block_until_ready()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", type=int, default=151936)  # Qwen3
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    params = SamplingParams.make(0.6, 0.95, 0, seed=1)  # Qwen3's generation_config without its top_k
    print(f"device: {jax.devices()[0].device_kind} ({jax.devices()[0].platform}), V = {args.vocab}, "
          f"temperature 0.6, top_p 0.95, top_k off, median of {args.repeats}\n")
    print("| T | sample, sorted (ms) | sample, top_p (ms) | speed-up | filter alone, sorted (ms) | filter alone, "
          "top_p (ms) |\n|---|---|---|---|---|---|")
    for t in args.rows:
        logits = jnp.asarray(np.random.default_rng(t).standard_normal((t, args.vocab)).astype(np.float32) * 3)
        positions = jnp.arange(t, dtype=jnp.int32)
        ms = {form: 1e3 * median_seconds(jax.jit(functools.partial(sampling.sample, form=form)), logits, positions,
                                         params, repeats=args.repeats) for form in ("sorted", "top_p")}
        filt = {form: 1e3 * median_seconds(jax.jit(functools.partial(sampling.filter_rows, form=form)), logits,
                                           params, repeats=args.repeats) for form in ("sorted", "top_p")}
        print(f"| {t} | {ms['sorted']:.2f} | {ms['top_p']:.2f} | {ms['sorted'] / ms['top_p']:.1f}x | "
              f"{filt['sorted']:.2f} | {filt['top_p']:.2f} |")


if __name__ == "__main__":
    main()
