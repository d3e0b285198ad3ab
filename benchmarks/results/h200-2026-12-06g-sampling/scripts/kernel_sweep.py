"""Tuning sweep of the decode window's two largest kernels at the Qwen3-30B-A3B shape (at T = 1 each also tries its
reduction: tl.dot, or a GEMV a token): the expert FFN (bf16, T = 1 and 8; N = T x 8 distinct experts of 128) and the
stacked attention products (q/k/v: K 2048 -> 4096 + 512 + 512; o: K 4096 -> 2048; T = 1 and 8, read at a rotating
layer of 24 stacked). Coordinate descent from the kernels' defaults: one knob at a time over its values, the others
held, two passes. Each time is the median of synced calls, a call a fori_loop of INNER ops over other slots / layers (so L2
serves no repeat), divided by INNER.

    PYTHONPATH=. python3 kernel_sweep.py OUT.json   [SMOKE=1: tiny shapes in interpret mode, a syntax check]
"""
import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from strata_jax.pallas_kernels import expert_ffn as ffn
from strata_jax.pallas_kernels import stacked_linear as sl

SMOKE = os.environ.get("SMOKE") == "1"
SWEEP_S = float(os.environ.get("SWEEP_S", "1e9"))  # each case's share of it (SHARES); past it a case keeps its best
DEADLINE = 0.0
H, I, E, K, L = (256, 128, 16, 4, 3) if SMOKE else (2048, 768, 128, 8, 24)
QN, KVN = (256, 32) if SMOKE else (4096, 512)
INNER, ITERS = (2, 2) if SMOKE else (20, 30)
interp = SMOKE
out_path = sys.argv[1]
result = dict(device=common.device_info(), shapes=dict(H=H, I=I, E=E, K=K, L=L), ffn={}, linear={})
t_start = time.time()


def save():
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)


def timed(f, args_of) -> float:
    t = common.time_synced(lambda i: f(*args_of(i)), iters=ITERS, warmup=2)
    return t.median_ms * 1e3 / INNER  # us per op


key = jax.random.key(0)
kg, ku, kd, kx, kw = jax.random.split(key, 5)
gate = (jax.random.normal(kg, (E, I, H), jnp.float32) / np.sqrt(H)).astype(jnp.bfloat16)
up = (jax.random.normal(ku, (E, I, H), jnp.float32) / np.sqrt(H)).astype(jnp.bfloat16)
down = (jax.random.normal(kd, (E, H, I), jnp.float32) / np.sqrt(I)).astype(jnp.bfloat16)
rng = np.random.default_rng(0)

FFN_SPACE = dict(reduce=["dot", "sum"], block_i=[16, 32, 64], block_k=[128, 256, 512], block_h=[16, 32, 64], block_i_down=[128, 256],
                 n_split=[1, 2, 4, 8], num_warps=[2, 4, 8], num_stages=[2, 3, 4])
FFN_DEFAULT = dict(block_i=32, block_k=256, block_h=32, block_i_down=256, n_split=4, num_warps=4, num_stages=3,
                   reduce="dot")
LIN_SPACE = dict(reduce=["dot", "sum"], block_n=[32, 64, 128], block_k=[64, 128, 256], k_splits=[1, 2, 4, 8, 16], num_warps=[2, 4, 8],
                 num_stages=[2, 3, 4])
LIN_DEFAULT = dict(block_n=64, block_k=128, k_splits=4, num_warps=4, num_stages=3, reduce="dot")


def descend(name, space, default, measure, table):
    best, best_us = dict(default), measure(default)
    table.append(dict(config=dict(best), us=best_us))
    print(f"{name}: default {best_us:.2f} us", flush=True)
    for _ in range(2):
        moved = False
        for knob, values in space.items():
            for v in values:
                if v == best[knob] or time.time() > DEADLINE:
                    continue
                cfg = {**best, knob: v}
                try:
                    us = measure(cfg)
                except Exception as e:  # noqa: BLE001 (a config that does not compile or fit)
                    table.append(dict(config=cfg, error=str(e).splitlines()[0][:200]))
                    continue
                table.append(dict(config=cfg, us=us))
                if us < best_us * 0.985:
                    best, best_us, moved = cfg, us, True
                    print(f"{name}: {knob}={v} -> {us:.2f} us  ({time.time() - t_start:.0f} s)", flush=True)
            save()
        if not moved:
            break
    print(f"{name}: best {best} {best_us:.2f} us (default {table[0]['us']:.2f})", flush=True)
    return best, best_us


def run_ffn(t):
    space = FFN_SPACE if t <= 4 else {k: v for k, v in FFN_SPACE.items() if k != "reduce"}  # "sum": T <= 4
    n = min(t * K, E)
    x = jnp.asarray(rng.standard_normal((t, H)), jnp.bfloat16)
    comb = np.zeros((t, n), np.float32)
    for j in range(t):
        comb[j, [(j * K + c) % n for c in range(K)]] = 1.0 / K
    comb = jnp.asarray(comb)
    ids = [jnp.asarray(np.stack([rng.choice(E, n, replace=False) for _ in range(INNER)]), jnp.int32) for _ in range(4)]
    ref = ffn.expert_ffn_reference(x, gate, up, down, ids[0][0], comb)

    def measure(cfg, x=x, comb=comb, ids=ids, ref=ref):
        op = functools.partial(ffn.expert_ffn, interpret=interp, **cfg)
        out = op(x, gate, up, down, ids[0][0], comb)
        err = float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref)))
        if not err < 0.05:
            raise ValueError(f"wrong result: max rel err {err:.3g}")

        @jax.jit
        def f(xx, sets):
            return jax.lax.fori_loop(0, sets.shape[0], lambda r, a: a + op(xx, gate, up, down, sets[r], comb),
                                     jnp.zeros(xx.shape, jnp.float32))
        return timed(f, lambda i: (x, ids[i % 4]))

    table = []
    best, us = descend(f"expert_ffn T={t}", space, FFN_DEFAULT, measure, table)
    mb = n * 3 * H * I * 2 / 1e6
    result["ffn"][str(t)] = dict(best=best, best_us=us, default_us=table[0]["us"], mbytes=mb, table=table)
    save()



def run_lin(label, t):
    ns, kdim = {"qkv": ((QN, KVN, KVN), H), "o": ((H,), QN)}[label]
    ws = tuple((jax.random.normal(jax.random.fold_in(kw, j), (L, kdim, nj), jnp.float32) / np.sqrt(kdim)
                ).astype(jnp.bfloat16) for j, nj in enumerate(ns))
    if True:
        x = jnp.asarray(rng.standard_normal((t, kdim)), jnp.bfloat16)
        ref = sl.stacked_linear_reference(x, ws, jnp.int32(1))

        def measure(cfg, x=x, ws=ws, ref=ref):
            op = functools.partial(sl.stacked_linear, interpret=interp, **cfg)
            out = op(x, ws, jnp.int32(1))
            err = float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref)))
            if not err < 0.02:
                raise ValueError(f"wrong result: max rel err {err:.3g}")

            @jax.jit
            def f(xx, start):
                return jax.lax.fori_loop(0, INNER, lambda r, a: a + op(xx, ws, (start + r) % L),
                                         jnp.zeros((xx.shape[0], sum(ns)), jnp.float32))
            return timed(f, lambda i: (x, jnp.int32(i % L)))

        table = []
        space = LIN_SPACE if t <= 4 else {k: v for k, v in LIN_SPACE.items() if k != "reduce"}
        best, us = descend(f"stacked_linear {label} T={t}", space, LIN_DEFAULT, measure, table)
        mb = kdim * sum(ns) * 2 / 1e6
        result["linear"][f"{label}:{t}"] = dict(best=best, best_us=us, default_us=table[0]["us"], mbytes=mb,
                                               table=table)
        save()



SHARES = {("ffn", 1): 0.3, ("qkv", 1): 0.17, ("o", 1): 0.17, ("ffn", 8): 0.2, ("qkv", 8): 0.08, ("o", 8): 0.08}
for case, share in SHARES.items():
    DEADLINE = time.time() + share * SWEEP_S
    run_ffn(case[1]) if case[0] == "ffn" else run_lin(*case)

bw = common.measure_read_bandwidth((64 if SMOKE else 4096) * 2**20, reps=5)
result["bandwidth_Bps"] = bw["bandwidth_Bps"]
save()
print(f"read bandwidth {bw['bandwidth_Bps'] / 1e12:.2f} TB/s; done in {time.time() - t_start:.0f} s", flush=True)
for t, r in result["ffn"].items():
    print(f"expert_ffn T={t}: {r['default_us']:.1f} -> {r['best_us']:.1f} us ({r['mbytes']:.1f} MB: "
          f"{r['mbytes'] / r['best_us']:.2f} TB/s) {r['best']}")
for k_, r in result["linear"].items():
    print(f"stacked_linear {k_}: {r['default_us']:.1f} -> {r['best_us']:.1f} us ({r['mbytes']:.1f} MB: "
          f"{r['mbytes'] / r['best_us']:.2f} TB/s) {r['best']}")
