"""The host pool's C expert kernel (host_pool/native_experts.c) against the numpy jobs and a float64 reference: every
store format (float32, bf16, int8, int4), window sizes around its 4-token passes and NATIVE_MAX_TOKENS, ragged
sizes (lane and block tails), thread counts, plain and split jobs; the build without -march / OpenMP; the switch; the
read-bandwidth probe.

Tolerance: float32 compute 1e-5 relative (only the float32 summation order differs); bf16 compute (bf16 weights, and
int8 / int4 by default) rounds g, u, h and each expert's output to bf16, so a float32 sum next to a rounding boundary
may round the other way than the other path's (one bf16 ulp in that element): 2^-8 relative per expert row.
"""

import platform

import numpy as np
import pytest

from helpers import reference_ffn, reference_rows, rel_fro, rng_for, rounding
from strata_jax.host_pool import HostExpertStore, HostPool, native
from strata_jax.host_pool import pool as pool_module
from strata_jax.host_pool.store import BF16
from strata_jax.model import quant

LAYERS, E = 2, 7
# H a multiple of 64 (int4's groups) but not of the phase-2 block; I = 80: 16-lane loops with no tail, a ragged
# phase-1 block; float formats also run H, I with lane tails.
SHAPES = {"int4": (192, 128), "int8": (144, 80), "float32": (144, 77), "bfloat16": (144, 77)}
TOL = {"float32": 1e-5, "bfloat16": 2.0**-8}


@pytest.fixture(scope="module")
def kernel():
    built = native.experts_kernel() if native.mode() != "off" else None
    if built is None:
        pytest.skip(native.describe_experts())
    return built


def make_store(rng, fmt, compute_dtype=None, shape=None, quant_format=None):
    """(float64 weights per layer as the pool must see them, a HostExpertStore in `fmt`); `shape` (H, I) and
    `quant_format` (quant.py's name, e.g. "int4-g32") replace SHAPES[fmt] and `fmt` for quantizing."""
    H, I = shape or SHAPES[fmt]
    shapes = ((E, I, H), (E, I, H), (E, H, I))
    reference, stored = [], []
    for _ in range(LAYERS):
        floats = [(rng.standard_normal(shape) * rng.uniform(0.05, 0.2, shape[:2] + (1,))).astype(np.float32)
                  for shape in shapes]
        if fmt in ("int8", "int4"):
            qs = [quant.quantize(a, quant_format or fmt) for a in floats]
            reference.append([quant.dequantize(qa).astype(np.float64) for qa in qs])
            # int8: one scale per output row, [E, O] in the store
            stored.append((*(qa.q for qa in qs), *(qa.scale[..., 0] if fmt == "int8" else qa.scale for qa in qs)))
        else:
            dtype = BF16 if fmt == "bfloat16" else np.float32
            stored.append(tuple(a.astype(dtype) for a in floats))
            reference.append([a.astype(np.float64) for a in stored[-1]])
    dtype = None if compute_dtype is None else np.dtype(compute_dtype)
    return reference, HostExpertStore(stored, compute_dtype=dtype)


def both_paths(monkeypatch, store, threads, run):
    """run(pool) with the C kernel, then with the numpy jobs (STRATA_POOL_NATIVE=0)."""
    out = []
    for switch in ("1", "0"):
        monkeypatch.setenv(native.ENV, switch)
        with HostPool(store, threads=threads) as pool:
            out.append(run(pool))
            out.append(pool.stats.jobs)
    return out


CASES = [("float32", None), ("bfloat16", None), ("int8", "bfloat16"), ("int8", "float32"), ("int4", "bfloat16"),
         ("int4", "float32")]


@pytest.mark.parametrize("fmt,compute", CASES)
@pytest.mark.parametrize("T", [1, 3, 5, pool_module.NATIVE_MAX_TOKENS])
def test_plain_jobs_match_numpy_and_reference(kernel, monkeypatch, fmt, compute, T):
    rng = rng_for(f"native-plain-{fmt}-{compute}-{T}")
    reference, store = make_store(rng, fmt, compute)
    H = store.hidden_size(0)
    ids = np.array([6, -1, 0, 3, 2, -1], np.int32)
    x = rng.standard_normal((T, H)).astype(np.float32)
    w = (rng.uniform(0.1, 1.0, (T, ids.size)) * (ids >= 0)).astype(np.float32)
    if T > 1:
        w[0, 2] = 0.0  # token 0 does not use expert 0
    y_c, jobs_c, y_np, jobs_np = both_paths(monkeypatch, store, 3, lambda pool: pool.compute(1, x, ids, w))
    assert jobs_c == 1 and jobs_np > 1  # the C path ran as one call, the numpy path as thread jobs
    compute_dtype = str(store.compute_dtype)
    ref = reference_ffn(reference[1], x, ids, w, rounding(compute_dtype))
    assert rel_fro(y_c, ref) < TOL[compute_dtype]
    assert rel_fro(y_c, y_np) < TOL[compute_dtype]


@pytest.mark.parametrize("fmt,compute", CASES)
@pytest.mark.parametrize("T,K", [(1, 4), (6, 3)])
def test_split_jobs_match_numpy_and_reference(kernel, monkeypatch, fmt, compute, T, K):
    rng = rng_for(f"native-split-{fmt}-{compute}-{T}-{K}")
    reference, store = make_store(rng, fmt, compute)
    H = store.hidden_size(0)
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int32)  # [T, K]
    ids[0, -1] = -1
    w = rng.uniform(0.05, 0.95, (T, K)).astype(np.float32)
    w[0, 0] = 0.9

    def run(pool):
        ticket = pool.submit_split(0, x, ids, w, 0.5)
        return pool.wait_heavy(ticket).copy(), pool.collect_split(ticket)

    (heavy_c, rows_c), jobs_c, (_, rows_np), _ = both_paths(monkeypatch, store, 2, run)
    heavy = (ids >= 0) & (w >= np.float32(0.5))
    assert jobs_c == int(heavy.any()) + int((~heavy & (ids >= 0)).any())  # one call per phase with entries
    compute_dtype = str(store.compute_dtype)
    ref = reference_rows(reference[0], x, ids, rounding(compute_dtype))
    for t, k in zip(*np.nonzero(ids >= 0)):
        assert rel_fro(rows_c[t, k], ref[t, k]) < TOL[compute_dtype], (t, k)
        assert rel_fro(rows_c[t, k], rows_np[t, k]) < TOL[compute_dtype], (t, k)
    np.testing.assert_array_equal(rows_c[ids < 0], 0.0)
    np.testing.assert_array_equal(heavy_c[heavy], rows_c[heavy])
    np.testing.assert_array_equal(heavy_c[~heavy], 0.0)


def test_threads_do_not_change_the_bits(kernel, monkeypatch):
    """Each output element is summed by one thread in a fixed order: 1, 2 and 5 threads give the same bits."""
    rng = rng_for("native-threads")
    _, store = make_store(rng, "bfloat16")
    x = rng.standard_normal((4, store.hidden_size(0))).astype(np.float32)
    ids = np.array([1, 4, 5, 0], np.int32)
    w = rng.random((4, 4)).astype(np.float32)
    monkeypatch.setenv(native.ENV, "1")
    outs = []
    for threads in (1, 2, 5):
        with HostPool(store, threads=threads) as pool:
            outs.append(pool.compute(0, x, ids, w))
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(outs[0], outs[2])


def former_kernel():
    """The build with the former job: an OpenMP region per job, fixed blocks (measure.py's comparison)."""
    former, line = native.experts_variant(("TEAM_OMP", "BLOCKS_FIXED"))
    if former is None:
        pytest.skip(line)
    return former


@pytest.mark.parametrize("fmt,compute", CASES)
def test_the_former_team_and_blocks_give_the_same_bits(kernel, monkeypatch, fmt, compute):
    """The kept team with job-sized blocks and the former OpenMP region with fixed blocks: the blocks only decide
    which thread computes an element, so 1 to 4 threads (more than this machine's cores too), one expert (a block
    running from one unit into the next) and several, give the former job's bits."""
    former = former_kernel()
    rng = rng_for(f"native-former-{fmt}-{compute}")
    _, store = make_store(rng, fmt, compute)
    monkeypatch.setenv(native.ENV, "1")
    for T, ids in ((1, [4]), (3, [1, 4, 5, 0]), (6, [6, 2, -1])):
        x = rng.standard_normal((T, store.hidden_size(0))).astype(BF16).astype(np.float32)
        ids = np.array(ids, np.int32)
        w = (rng.random((T, ids.size)) * (ids >= 0)).astype(np.float32)
        for threads in (1, 2, 3, 4):
            with HostPool(store, threads=threads) as pool:
                y_new = pool.compute(1, x, ids, w)
                with monkeypatch.context() as m:
                    m.setattr(native, "experts_kernel", lambda: former)
                    y_former = pool.compute(1, x, ids, w)
            np.testing.assert_array_equal(y_new, y_former)


@pytest.mark.parametrize("fmt,compute,shape,quant_format", [
    ("int4", "bfloat16", (256, 384), None), ("int4", "bfloat16", (192, 320), None),  # whole blocks; a partial one
    ("int4", "bfloat16", (256, 128), "int4-g32"), ("int4", "bfloat16", (256, 128), "int4-g128"),
    ("int4", "float32", (256, 384), None), ("int8", "bfloat16", (144, 80), None), ("int8", "float32", (256, 128), None)])
def test_the_former_loops_give_the_same_bits(kernel, monkeypatch, fmt, compute, shape, quant_format):
    """The int4 loop with a constant half group (and its high bytes by a shuffle, Intel builds' form), int8's rows
    with one token two to four a call: the same products and sums as the former loops (-DFORMER_LOOPS), so their
    bits, for bf16 x (the bf16 path) and float32 x (the float path), 1 to 5 tokens and 1 to 3 threads."""
    builds = {}
    for defines in (("FORMER_LOOPS",), ("INT4_SHUFFLES",), ("INT4_SHIFTS",)):
        builds[defines], line = native.experts_variant(defines)
        if builds[defines] is None:
            pytest.skip(line)
    rng = rng_for(f"native-former-loops-{fmt}-{compute}-{shape}-{quant_format}")
    _, store = make_store(rng, fmt, compute, shape, quant_format)
    monkeypatch.setenv(native.ENV, "1")
    for T, ids, threads in ((1, [4], 1), (1, [1, 4, 5, 0], 2), (2, [6, 2], 3), (5, [3, -1, 0], 2)):
        for dtype in (BF16, np.float32):
            x = rng.standard_normal((T, store.hidden_size(0))).astype(dtype).astype(np.float32)
            ids = np.array(ids, np.int32)
            w = (rng.random((T, ids.size)) * (ids >= 0)).astype(np.float32)
            with HostPool(store, threads=threads) as pool:
                y_new = pool.compute(1, x, ids, w)
                for build in builds.values():
                    with monkeypatch.context() as m:
                        m.setattr(native, "experts_kernel", lambda build=build: build)
                        np.testing.assert_array_equal(pool.compute(1, x, ids, w).view(np.uint32), y_new.view(np.uint32))


@pytest.mark.parametrize("rows,threads,phase", [(768, 16, 0), (1536, 16, 0), (2304, 16, 0), (6144, 16, 0),
                                               (768, 2, 0), (2048, 16, 1), (2048, 3, 1), (320, 3, 0), (77, 2, 0),
                                               (6, 4, 1)])
def test_blocks_are_sized_to_the_job(kernel, rows, threads, phase):
    """Every row in one block; a multiple of the threads of blocks (when the rows allow), of near-equal sizes on
    4-row multiples (the last takes a ragged tail): one expert's 768 phase-1 rows on 16 threads are 32 blocks of 24
    (the former 24 of 32 gave half the team a second round); the former build's fixed blocks of 32 and 16 rows."""
    sizes = kernel.blocks(rows, threads, phase)
    assert sum(sizes) == rows and min(sizes) > 0
    if rows >= 4 * threads:
        assert len(sizes) % threads == 0
        assert all(size % 4 == 0 for size in sizes[:-1]) and max(sizes[:-1]) - min(sizes) <= 4
    assert (rows, threads, phase) != (768, 16, 0) or sizes == [24] * 32
    assert (rows, threads, phase) != (2048, 16, 1) or sizes == [16] * 128
    former = former_kernel()
    fixed = 32 if phase == 0 else 16
    assert former.blocks(rows, threads, phase) == [fixed] * (rows // fixed) + ([rows % fixed] if rows % fixed else [])


def test_callers_at_once_each_take_a_team(kernel, monkeypatch):
    """Pools whose jobs run at once (each its own driver thread) each take a free team (a new one if none is): the
    same bits as one at a time, no job lost or mixed."""
    import threading
    rng = rng_for("native-callers")
    _, store = make_store(rng, "bfloat16")
    monkeypatch.setenv(native.ENV, "1")
    jobs = []
    for k in range(3):
        T = 1 + k
        x = rng.standard_normal((T, store.hidden_size(0))).astype(np.float32)
        ids = np.array([k, k + 2, 6 - k], np.int32)
        jobs.append((x, ids, rng.random((T, 3)).astype(np.float32)))
    pools = [HostPool(store, threads=2) for _ in jobs]
    try:
        alone = [pool.compute(0, *job) for pool, job in zip(pools, jobs)]
        results = [[] for _ in jobs]

        def run(k):
            for _ in range(40):
                results[k].append(pools[k].compute(0, *jobs[k]))

        threads = [threading.Thread(target=run, args=(k,)) for k in range(len(jobs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        for k, outs in enumerate(results):
            assert len(outs) == 40
            for out in outs:
                np.testing.assert_array_equal(out, alone[k])
    finally:
        for pool in pools:
            pool.close()


def test_windows_past_the_limit_run_the_blas_jobs(kernel, monkeypatch):
    rng = rng_for("native-limit")
    reference, store = make_store(rng, "float32")
    T = pool_module.NATIVE_MAX_TOKENS + 1
    x = rng.standard_normal((T, store.hidden_size(0))).astype(np.float32)
    ids = np.array([2, 3], np.int32)
    w = rng.random((T, 2)).astype(np.float32)
    monkeypatch.setenv(native.ENV, "1")
    with HostPool(store, threads=2) as pool:
        y = pool.compute(0, x, ids, w)
        assert pool.stats.jobs > 1  # thread jobs, not one C call
    assert rel_fro(y, reference_ffn(reference[0], x, ids, w)) < TOL["float32"]


def test_the_build_says_what_it_uses(kernel, monkeypatch):
    monkeypatch.delenv(native.ENV, raising=False)
    line = native.describe_experts()
    assert line.startswith("expert jobs: C, ") and ("OpenMP" in line), line
    monkeypatch.setenv(native.ENV, "0")
    assert native.experts_kernel() is None and native.describe_experts() == "expert jobs: numpy (STRATA_POOL_NATIVE=0)"


AVX2 = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC")


@pytest.mark.parametrize("flags", [native.EXPERTS_FLAGS[-1], AVX2], ids=["no-march-no-openmp", "avx2"])
def test_the_plain_build_matches(kernel, monkeypatch, tmp_path, flags):
    """The last fallback build (no -march=native: GNU vectors for SSE2 or scalar code; no OpenMP: one thread) and the
    AVX2 build (x86) run the same jobs: within the float32 tolerance of the default build (other lanes, other
    order)."""
    if flags == AVX2 and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("AVX2 is x86's")
    path = tmp_path / "plain.so"
    native._compile(native._find_compiler(), flags, path, native.EXPERTS_SOURCE)
    plain = native.ExpertsKernel(path)
    assert ("no OpenMP" in plain.build) == (flags != AVX2)
    assert flags != AVX2 or plain.build.startswith("AVX2")
    rng = rng_for("native-plain-build")
    for fmt in ("bfloat16", "int4"):
        reference, store = make_store(rng, fmt, "float32")
        x = rng.standard_normal((3, store.hidden_size(0))).astype(np.float32)
        ids = np.array([0, 5, -1, 2], np.int32)
        w = rng.random((3, 4)).astype(np.float32)
        monkeypatch.setenv(native.ENV, "1")
        with HostPool(store, threads=2) as pool:
            y_default = pool.compute(1, x, ids, w)
            monkeypatch.setattr(native, "experts_kernel", lambda: plain)
            y_plain = pool.compute(1, x, ids, w)
            monkeypatch.undo()
        assert rel_fro(y_plain, y_default) < 1e-5
        assert rel_fro(y_plain, reference_ffn(reference[1], x, ids, w, rounding("float32"))) < 1e-5


def test_read_probe_reads_every_word(kernel):
    rng = rng_for("native-read")
    words = rng.integers(0, 2**40, 8 * 1000 + 8, dtype=np.uint64)
    for threads in (1, 3):
        assert kernel.read_words(words.ctypes.data, len(words), threads) == int(words.sum())


def test_the_timeline_counts_each_job_in_order(kernel, monkeypatch):
    """measure.py --timeline: off, jobs leave no trace; on, each job's setup, the team's entry, phase 1 and the
    region's end are counted, in that order; the results are the same bits as without it."""
    rng = rng_for("native-timeline")
    _, store = make_store(rng, "bfloat16")
    x = rng.standard_normal((3, store.hidden_size(0))).astype(np.float32)
    ids = np.array([2, 6, 3], np.int32)
    w = rng.random((3, 3)).astype(np.float32)
    monkeypatch.setenv(native.ENV, "1")
    with HostPool(store, threads=2) as pool:
        kernel.timeline(False)  # zeroed, off
        plain = pool.compute(0, x, ids, w)
        assert kernel.timeline(True)["jobs"] == 0
        timed = [pool.compute(0, x, ids, w) for _ in range(3)]
        t = kernel.timeline(False)
    assert t["jobs"] == 3
    assert 0 <= t["first_in"] <= t["last_in"] <= t["phase1"] <= t["job"] and t["setup"] >= 0 and t["job"] > 0
    for out in timed:
        np.testing.assert_array_equal(out, plain)


# The bf16 dot-product path (AVX-512 BF16 builds): phase 1 takes it when every x value is exactly bf16 (as a bf16
# model's device sends x), phase 2 when h is rounded to bf16. The products are the float path's (exact operands), so
# the tolerances are the same. Shapes: rows of a multiple of 128 inputs and not (masked last block), int4 groups of
# 32, 64 and 128 (several groups a 64-byte block, one, or a block in half a group).
BF16_X_CASES = [("bfloat16", None, (144, 77), None), ("int8", "bfloat16", (144, 80), None),
                ("int8", "float32", (256, 128), None), ("int4", "bfloat16", (192, 128), None),
                ("int4", "float32", (256, 384), None), ("int4", "bfloat16", (160, 96), "int4-g32"),
                ("int4", "bfloat16", (256, 128), "int4-g128")]


@pytest.mark.parametrize("fmt,compute,shape,quant_format", BF16_X_CASES)
@pytest.mark.parametrize("T", [1, 2, 3, 6, pool_module.NATIVE_MAX_TOKENS])
def test_bf16_x_matches_numpy_and_reference(kernel, monkeypatch, fmt, compute, shape, quant_format, T):
    rng = rng_for(f"native-bf16x-{fmt}-{compute}-{shape}-{quant_format}-{T}")
    reference, store = make_store(rng, fmt, compute, shape, quant_format)
    H = store.hidden_size(0)
    ids = np.array([6, -1, 0, 3, 2, 5], np.int32)
    x = rng.standard_normal((T, H)).astype(BF16).astype(np.float32)  # exactly bf16
    w = (rng.uniform(0.1, 1.0, (T, ids.size)) * (ids >= 0)).astype(np.float32)
    y_c, _, y_np, _ = both_paths(monkeypatch, store, 2, lambda pool: pool.compute(1, x, ids, w))
    compute_dtype = str(store.compute_dtype)
    ref = reference_ffn(reference[1], x, ids, w, rounding(compute_dtype))
    assert rel_fro(y_c, ref) < TOL[compute_dtype]
    assert rel_fro(y_c, y_np) < TOL[compute_dtype]


@pytest.mark.parametrize("fmt,compute,quant_format", [("bfloat16", None, None), ("int8", "bfloat16", None),
                                                      ("int4", "bfloat16", None), ("int4", "float32", "int4-g32")])
def test_the_float_path_build_matches(kernel, monkeypatch, tmp_path, fmt, compute, quant_format):
    """The build without the bf16 dot products (-DNO_BF16_DOT: the float path, as on AVX-512 CPUs without BF16)
    runs the same jobs within the tolerance of the default build; with float32 compute and bf16 x only phase 1
    differs (the products are exact either way: float32 summation order only)."""
    if "BF16 dot" not in kernel.build:
        pytest.skip(f"no bf16 dot products in this build ({kernel.build})")
    path = tmp_path / "float_path.so"
    native._compile(native._find_compiler(), (*native.EXPERTS_FLAGS[0], "-DNO_BF16_DOT"), path, native.EXPERTS_SOURCE)
    float_path = native.ExpertsKernel(path)
    assert "BF16 dot" not in float_path.build
    rng = rng_for(f"native-float-path-{fmt}-{compute}-{quant_format}")
    _, store = make_store(rng, fmt, compute, (256, 128), quant_format)
    compute_dtype = str(store.compute_dtype)
    for T in (1, 4, 7):
        x = rng.standard_normal((T, store.hidden_size(0))).astype(BF16).astype(np.float32)
        ids = np.array([0, 5, -1, 2], np.int32)
        w = rng.random((T, 4)).astype(np.float32)
        monkeypatch.setenv(native.ENV, "1")
        with HostPool(store, threads=2) as pool:
            y_default = pool.compute(1, x, ids, w)
            monkeypatch.setattr(native, "experts_kernel", lambda: float_path)
            y_float = pool.compute(1, x, ids, w)
            monkeypatch.undo()
        assert rel_fro(y_default, y_float) < (1e-5 if compute_dtype == "float32" else TOL[compute_dtype])


def test_measure_timeline_gives_the_kernels_own_ratio(monkeypatch, capsys):
    """`python -m strata_jax.host_pool.measure --timeline` (small shapes): under each path-C row the mean job's
    timeline, and for a quantized format its region against bf16's (what the engine's native calls see, without the
    Python pool's hand-off in ms/job); on Linux under it the team's run delay and context switches a job a worker
    (a late worker: no core, or asleep)."""
    from strata_jax.host_pool import measure, native
    if native.experts_kernel() is None:
        pytest.skip(f"no native expert kernel here: {native.describe_experts()}")
    monkeypatch.setattr("sys.argv", ["measure", "--threads=2", "--formats=bf16,int8", "--windows=1", "--paths=C",
                                     "--timeline", "--hidden=256", "--intermediate=128", "--experts=2",
                                     "--store-experts=4", "--repeats=2", "--read_mb=16", "--hot-intermediate=0"])
    measure.main()
    lines = capsys.readouterr().out.splitlines()
    timelines = [ln for ln in lines if "timeline, mean of" in ln]
    assert len(timelines) == 2, lines
    assert "region vs bf16" not in timelines[0]
    ratio = float(timelines[1].split("region vs bf16 ")[1].rstrip("x"))
    assert 0 < ratio < 10, timelines[1]
    if platform.system() == "Linux":  # under each timeline, the workers' wait for a core and their switches a job
        workers = [lines[lines.index(t) + 1] for t in timelines]
        for ln in workers:
            assert ln.split()[:3] == ["workers:", "run", "delay"], ln
            delay, switches = float(ln.split("delay ")[1].split()[0]), float(ln.split("core), ")[1].split()[0])
            assert delay >= 0 and switches >= 0, ln


def test_build_settings_come_from_the_environment(kernel, monkeypatch):
    """STRATA_POOL_DEFINES: the engine's pool built with other -D settings of native_experts.c (to time one in the
    generate loop, where measure.py's --variants time it alone): the build line names them and the jobs stay within
    the float32 tolerance of the default build's; a bad value is one line."""
    rng = rng_for("native-defines")
    reference, store = make_store(rng, "bfloat16", "float32")
    x = rng.standard_normal((2, store.hidden_size(0))).astype(np.float32)
    ids = np.array([4, 0, 6], np.int32)
    w = rng.random((2, 3)).astype(np.float32)
    monkeypatch.setenv(native.ENV, "1")
    monkeypatch.delenv(native.DEFINES_ENV, raising=False)
    with HostPool(store, threads=2) as pool:
        y_default = pool.compute(1, x, ids, w)
    monkeypatch.setattr(native, "_experts_built", None)  # built again in this process (restored after the test)
    monkeypatch.setenv(native.DEFINES_ENV, "ROWS_DOWN=8, TEAM_SPIN_US=300, TEAM_SPIN_YIELD=1")
    assert "-DROWS_DOWN=8 -DTEAM_SPIN_US=300 -DTEAM_SPIN_YIELD=1" in native.describe_experts()
    short = native.describe_experts(short=True)
    assert short.endswith(", STRATA_POOL_DEFINES=ROWS_DOWN=8,TEAM_SPIN_US=300,TEAM_SPIN_YIELD=1"), short
    with HostPool(store, threads=2) as pool:
        y = pool.compute(1, x, ids, w)
    assert rel_fro(y, y_default) < 1e-5
    assert rel_fro(y, reference_ffn(reference[1], x, ids, w, rounding("float32"))) < 1e-5
    for bad in ("rows_down=8", "ROWS_DOWN=eight", "-O0"):
        monkeypatch.setenv(native.DEFINES_ENV, bad)
        with pytest.raises(ValueError, match="STRATA_POOL_DEFINES=.* is not NAME or NAME=INTEGER") as e:
            HostPool(store, threads=1)
        assert "\n" not in str(e.value)
