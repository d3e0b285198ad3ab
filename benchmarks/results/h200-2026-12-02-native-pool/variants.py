"""The C expert kernel's work-item sizes and thread counts on this machine (issue 33's tuning, one run):
bf16 / int4 layer jobs of 8 experts (30B shape) at T=1 and 4, per build variant, beside the read bandwidth.

    PYTHONPATH=. python3 benchmarks/results/h200-2026-12-02-native-pool/variants.py
"""
import tempfile
import time
from pathlib import Path

import numpy as np

from strata_jax.host_pool import native
from strata_jax.host_pool.measure import make_store, read_gbps
from strata_jax.host_pool.pool import HostPool, usable_cores

H, I, E = 2048, 768, 48
cores = usable_cores()
print(f"cores {cores}; read bandwidth {read_gbps(2 << 30, cores):.1f} GB/s ({cores} threads), "
      f"{read_gbps(2 << 30, max(1, cores // 2)):.1f} GB/s ({max(1, cores // 2)} threads)", flush=True)
rng = np.random.default_rng(0)
stores = {fmt: make_store(fmt, rng, E, H, I)[1] for fmt in ("bf16", "int4")}
folder = Path(tempfile.mkdtemp())
compiler = native._find_compiler()
default = native.experts_kernel()
print(native.describe_experts(), flush=True)
for up, down in ((8, 16), (32, 16), (32, 64), (64, 32), (128, 64)):
    path = folder / f"v{up}-{down}.so"
    native._compile(compiler, native.EXPERTS_FLAGS[0] + (f"-DROWS_UP={up}", f"-DROWS_DOWN={down}"), path,
                    native.EXPERTS_SOURCE)
    kernel = native.ExpertsKernel(path)
    native.experts_kernel = lambda kernel=kernel: kernel
    for threads in sorted({cores, max(1, cores // 2), max(1, cores - 2)}):
        for fmt, store in stores.items():
            with HostPool(store, threads=threads) as pool:
                for T in (1, 4):
                    x = rng.standard_normal((T, H)).astype(np.float32)
                    best = float("inf")
                    for _ in range(40):
                        ids = rng.choice(E, 8, replace=False).astype(np.int32)
                        w = rng.random((T, 8)).astype(np.float32)
                        t0 = time.perf_counter()
                        pool.compute(0, x, ids, w)
                        best = min(best, time.perf_counter() - t0)
                    gbs = 8 * store.nbytes(0, 0) / best / 1e9
                    print(f"rows up {up:3d} down {down:3d} threads {threads:2d} {fmt:5s} T={T}: "
                          f"{best * 1e3:6.2f} ms/job {gbs:6.1f} GB/s", flush=True)
