"""What one pool call costs inside a jitted graph on this machine, beyond the pool's compute (issue 33 item 2).

A graph of 12 chained io_callbacks (each depends on the last, as the decode graph's 12 MoE layers), timed per call
and divided by 12, for: an identity callback; pool.compute of 8 bf16 experts (30B shape, T=1) in the C kernel; the
same pool job timed outside the graph. Each variant runs in its own process (OpenMP reads its environment once):

    PYTHONPATH=. python3 benchmarks/results/h200-2026-12-02-native-pool/callback_cost.py
"""
import os
import subprocess
import sys
import time

VARIANTS = {
    "default": {},
    "omp passive": {"OMP_WAIT_POLICY": "passive"},
    "omp spin 10k": {"GOMP_SPINCOUNT": "10000"},
    "threads 15": {"CALLBACK_THREADS": "15"},
    "switch 0.1ms": {"CALLBACK_SWITCH": "0.0001"},
}


def child() -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import io_callback

    from strata_jax.host_pool import HostExpertStore, HostPool
    from strata_jax.host_pool.measure import make_store
    from strata_jax.host_pool.pool import usable_cores

    if os.environ.get("CALLBACK_SWITCH"):
        sys.setswitchinterval(float(os.environ["CALLBACK_SWITCH"]))
    H, I, E, L = 2048, 768, 48, 12
    rng = np.random.default_rng(0)
    _, store = make_store("bf16", rng, E, H, I)
    pool = HostPool(store, threads=int(os.environ.get("CALLBACK_THREADS", usable_cores())))
    ids = np.arange(8, dtype=np.int32)
    w = np.full((1, 8), 0.125, np.float32)

    def identity(x):
        return np.asarray(x)

    def expert_job(x):
        return pool.compute(0, np.asarray(x), rng.choice(E, 8, replace=False).astype(np.int32), w)

    def chain(fn):
        @jax.jit
        def graph(x):
            for _ in range(L):
                y = io_callback(fn, jax.ShapeDtypeStruct((1, H), jnp.float32), x, ordered=False)
                x = x + 1e-3 * y
            return x
        return graph

    x0 = jnp.asarray(rng.standard_normal((1, H)), jnp.float32) * 1e-2
    out = {}
    for name, fn in (("identity", identity), ("pool job", expert_job)):
        graph = chain(fn)
        jax.block_until_ready(graph(x0))
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            jax.block_until_ready(graph(x0))
            times.append(time.perf_counter() - t0)
        out[name.replace(" ", "_")] = float(np.median(times)) / L * 1e3
    times = []
    for _ in range(100):
        t0 = time.perf_counter()
        expert_job(np.asarray(x0))
        times.append(time.perf_counter() - t0)
    out["outside"] = float(np.median(times)) * 1e3
    print("RESULT " + " ".join(f"{k}={v:.3f}" for k, v in out.items()), flush=True)
    pool.close()


def main() -> None:
    print(f"{'variant':14s} {'identity ms':>12s} {'pool job ms':>12s} {'job outside ms':>15s} {'beyond compute':>15s}", flush=True)
    for name, env in VARIANTS.items():
        done = subprocess.run([sys.executable, __file__, "--child"], env={**os.environ, **env}, capture_output=True,
                              text=True, timeout=240)
        line = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
        if not line:
            print(f"{name:14s} failed: {done.stderr.strip().splitlines()[-3:]}")
            continue
        vals = dict(kv.split("=") for kv in line[0].split()[1:])
        ident, job, outside = (float(vals[k]) for k in ("identity", "pool_job", "outside"))
        print(f"{name:14s} {ident:12.3f} {job:12.3f} {outside:15.3f} {job - outside:15.3f}", flush=True)


if __name__ == "__main__":
    child() if "--child" in sys.argv else main()
