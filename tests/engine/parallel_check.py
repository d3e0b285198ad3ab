"""The equality checks of tests/engine/test_parallel.py, run in a process of its own: XLA_FLAGS=
--xla_force_host_platform_device_count=N must be set before JAX starts (the test sets it).

    python tests/engine/parallel_check.py [--cache_dir=DIR] layers:2 experts:2 experts:4 layers:2:4:0.5:lru

A split is mode:devices, or mode:devices:slots:pcie_frac:policy for offload (parallel=layers: each device keeps its
layers' slot caches). For each split, an engine over the tiny config's random float32 weights beside the
single-device engine with every expert resident (the exact path is placement-independent): prefill logits, decode
windows of T=1 and T=4 (teacher-forced, through the prefill and several windows) and greedy `generate` (T=1
windows, and verify windows with n-gram drafts). One JSON line per split (offload: with the decode's expert
counters), then the save_state lines, then the error lines.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from strata_jax.model.config import preset  # noqa: E402
from strata_jax.engine.api import Engine  # noqa: E402
from strata_jax.errors import StrataError  # noqa: E402

OPTS = dict(dtype="float32", expert_cache_slots="all", window=4, context=64, prefill_chunk=16, verbose=False,
            compile_graphs="lazy")  # each graph on its first use: the checks run few of the sizes (compile time)


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))


def main(splits: list[str]) -> None:
    cfg = preset("tiny")
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 256, 21).tolist()  # two prefill chunks (16 + 5)
    # repeats: the n-gram drafter proposes, windows of T = 4 run; 28 tokens, whole windows of 4 for score (30 ran a
    # last window of 2: one more pipeline of graphs per split, T = 2 being no size the check names)
    text = (prompt * 2)[:28]
    def run(eng):
        return dict(prefill=eng.prefill_logits(prompt), w1=eng.score(text, window=1), w4=eng.score(text, window=4),
                    gen1=eng.generate(text, max_new_tokens=10, draft="none"),
                    gen4=eng.generate(text, max_new_tokens=10, draft="ngram"),
                    gend=(eng.generate(text, max_new_tokens=10, draft="device"),  # drafts and acceptance on device
                          eng.generate(text, max_new_tokens=10, draft="device", temperature=0.8, seed=5)))

    # All-resident engines draw their stacked weights; offloaded ones the per-layer list (other values): one
    # reference of each form.
    resident, offloaded = [s for s in splits if s.count(":") == 1], [s for s in splits if s.count(":") > 1]
    t0 = time.perf_counter()
    refs = {"stacked": run(Engine.from_random(cfg, seed=3, **OPTS))}
    if offloaded:
        refs["list"] = run(Engine.from_random(cfg, seed=3, **{**OPTS, "layer_loop": "unrolled"}))
    print(json.dumps({"references_s": round(time.perf_counter() - t0, 1)}), flush=True)
    for split in splits:
        t0 = time.perf_counter()
        mode, n, *offload = split.split(":")
        extra = dict(zip(("expert_cache_slots", "pcie_frac", "cache_policy"), offload))
        eng = Engine.from_random(cfg, seed=3, devices=int(n), parallel=mode, **{**OPTS, **extra})
        ref, got = refs["list" if offload else "stacked"], run(eng)
        out = {"split": split, "line": eng.parallel.line}
        for k in ("prefill", "w1", "w4"):
            out[k] = rel(got[k], ref[k])
        for k in ("gen1", "gen4", "gend"):
            out[k] = got[k] == ref[k]
        out["tokens"] = got["gen4"]
        held = {}  # device -> bytes of the engine's weights it holds (host experts: in its host memory)
        for x in jax.tree.leaves(eng.weights):
            for shard in x.addressable_shards:
                key = f"{shard.device}:{x.sharding.memory_kind}"
                held[key] = held.get(key, 0) + shard.data.nbytes
        out["held"] = held
        if offload:
            stats = eng.stats.last.decode_experts
            out["experts"] = dict(fetched=stats.distinct_fetched, cpu=stats.distinct_cpu,
                                  resident=stats.distinct_resident)
            out["slot_devices"] = sorted({str(d) for s in eng.cache.experts if s for d in s.gate.devices()})
        out["seconds"] = round(time.perf_counter() - t0, 1)  # where the check's time goes (the test's report)
        print(json.dumps(out), flush=True)
    # The deferral (verify_defer_cpu=1) with parallel=layers: a device block's last layer is never deferred (its rows
    # must be in the activations that leave the device), and the windows run.
    t0 = time.perf_counter()
    if offloaded:
        eng = Engine.from_random(cfg, seed=3, devices=2, parallel="layers", verify_defer_cpu="1",
                                 **{**OPTS, "expert_cache_slots": "4", "pcie_frac": "0.5"})
        tokens = eng.generate(text, max_new_tokens=10, draft="ngram")
        print(json.dumps({"defer": eng.parallel.blocks, "no_defer": sorted(eng.decode_expert_path.no_defer),
                          "defer_active": eng.decode_expert_path.defer.active, "tokens": len(tokens),
                          "cpu": eng.stats.last.decode_experts.distinct_cpu}), flush=True)
        # pcie_frac=auto's choice crossing 1 on several devices: the stages keep their graphs (no swap), 1 is set as
        # data, and a later split is not taken (the pool's graphs are not rebuilt there)
        from strata_jax.offload import placement as placement_mod
        graphs, eng.placement.auto = eng.compiled, True
        seen = []
        for choice in (1.0, 0.5):
            placement_mod.adapt_pcie_frac = lambda *a, c=choice: (c, 1.0)
            eng._adapt_pcie_frac(eng.stats.last.decode_experts)
            seen.append(eng.placement.pcie_frac)
        print(json.dumps({"auto_fracs": seen, "auto_same_graphs": eng.compiled is graphs}), flush=True)
    # save_state of a split engine restores on one device with the same logits (the embedded checkpoint folder)
    print(json.dumps({"defer_s": round(time.perf_counter() - t0, 1)}), flush=True)
    t0 = time.perf_counter()
    import tempfile
    base = Engine.from_pretrained(None, **OPTS).prefill_logits(prompt)
    for split in resident[:2] + offloaded[:1] + [s for s in offloaded if s.startswith("experts")][:1]:
        mode, n, *offload = split.split(":")
        extra = dict(zip(("expert_cache_slots", "pcie_frac", "cache_policy"), offload))
        with tempfile.TemporaryDirectory() as tmp:
            Engine.from_pretrained(None, devices=int(n), parallel=mode, **{**OPTS, **extra}).save_state(
                Path(tmp) / "state")
            again = Engine.from_pretrained(str(Path(tmp) / "state"), **OPTS).prefill_logits(prompt)
        print(json.dumps({"saved": split, "prefill": rel(again, base)}), flush=True)
    print(json.dumps({"saved_s": round(time.perf_counter() - t0, 1)}), flush=True)
    for bad in (dict(devices=2, parallel="experts", expert_cache_slots="4", pcie_frac="0.5"), dict(devices=99),
                dict(devices=2, parallel="experts", expert_cache_slots="4", cache_policy="static"),
                dict(devices=4, parallel="layers")):  # the tiny model has 3 layers
        try:
            Engine.from_random(cfg, seed=3, **{**OPTS, **bad})
            print(json.dumps({"error": None, "options": bad}))
        except StrataError as e:
            print(json.dumps({"error": str(e), "options": bad}))


if __name__ == "__main__":
    flags = [a for a in sys.argv[1:] if a.startswith("--cache_dir=")]
    if flags:
        OPTS["cache_dir"] = flags[-1].split("=", 1)[1]
    main([a for a in sys.argv[1:] if not a.startswith("--")])
