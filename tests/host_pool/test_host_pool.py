"""Host pool: numerics against a float64 numpy reference, the jitted
io_callback bridge, submit/collect, counters and fault handling.

Tolerance: rel error ||y - ref|| / ||ref|| < 1e-5 for float32 weights. For
bf16 weights the reference uses the same bf16 values (bf16 -> f32 is exact),
so the same 1e-5 applies: only float32 accumulation differs.
"""

import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import random_layers, reference_ffn, rel_fro, rng_for
from strata_jax.host_pool import HostPoolError, cpu_expert_rows, unwrap_pool_error
from strata_jax.host_pool import pool as pool_module
from strata_jax.host_pool import store as store_module
from strata_jax.host_pool.pool import worker_timeline
from strata_jax.host_pool.store import BF16

# Ragged sizes so that job and chunk tails are exercised.
LAYERS, E, H, I = 2, 6, 80, 72
REL_TOL = 1e-5


def make_layers(rng, dtype=np.float32):
    """Per layer (gate [E, I, H], up [E, I, H], down [E, H, I]) at this file's sizes."""
    return random_layers(rng, dtype, layers=LAYERS, e=E, h=H, i=I)


def make_inputs(rng, T, ids):
    """x [T, H], ids [N], w [T, N] (0 where ids == -1 and for some tokens)."""
    ids = np.asarray(ids, np.int32)
    x = rng.standard_normal((T, H)).astype(np.float32)
    w = rng.random((T, ids.size)).astype(np.float32)
    w[:, ids < 0] = 0.0
    if T > 1 and ids.size > 1:
        w[0, 0] = 0.0  # token 0 does not use expert ids[0]
    return x, ids, w


IDS_CASES = {"one": [4], "several_padded": [5, -1, 0, 3, -1]}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("ids_case", list(IDS_CASES))
def test_matches_reference(make_pool, pool_path, dtype, threads, T, ids_case):
    rng = rng_for(f"ref-{dtype}-{threads}-{T}-{ids_case}")
    layers = make_layers(rng, BF16 if dtype == "bfloat16" else np.float32)
    pool = make_pool(layers, threads=threads)
    x, ids, w = make_inputs(rng, T, IDS_CASES[ids_case])
    y = pool.compute(1, x, ids, w)
    assert y.dtype == np.float32 and y.shape == (T, H)
    assert rel_fro(y, reference_ffn(layers[1], x, ids, w)) < REL_TOL


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this OS")
def test_default_threads_follow_the_cpu_affinity(make_pool):
    # Pinned to one core (taskset, a container's cpuset), the pool must not start one thread per machine core.
    rng = rng_for("affinity")
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(before)})
    try:
        assert pool_module.usable_cores() == 1
        layers = make_layers(rng, np.float32)
        pool = make_pool(layers)
    finally:
        os.sched_setaffinity(0, before)
    assert pool.threads == 1 and pool_module.usable_cores() == len(before)
    x, ids, w = make_inputs(rng, 2, [3, 1])
    assert rel_fro(pool.compute(0, x, ids, w), reference_ffn(layers[0], x, ids, w)) < REL_TOL


def test_bf16_converted_in_many_chunks(make_pool, monkeypatch):
    monkeypatch.setattr(store_module, "CHUNK_FLOATS", 5 * H)  # a few rows per chunk
    rng = rng_for("bf16-chunks")
    layers = make_layers(rng, BF16)
    pool = make_pool(layers, threads=3)
    x, ids, w = make_inputs(rng, 4, [2, 1, -1])
    assert rel_fro(pool.compute(0, x, ids, w), reference_ffn(layers[0], x, ids, w)) < REL_TOL


def test_all_padding_gives_zeros(make_pool):
    rng = rng_for("all-padding")
    pool = make_pool(make_layers(rng), threads=2)
    x, ids, w = make_inputs(rng, 4, [-1, -1])
    np.testing.assert_array_equal(pool.compute(0, x, ids, w), np.zeros((4, H), np.float32))


def test_submit_collect_matches_compute(make_pool):
    rng = rng_for("submit-collect")
    layers = make_layers(rng)
    pool = make_pool(layers, threads=3)
    jobs = [(layer, *make_inputs(rng, 4, [1, -1, 5])) for layer in (0, 1)]
    handles = [pool.submit(*job) for job in jobs]  # both in flight
    for handle, (layer, x, ids, w) in zip(handles, jobs):
        y = pool.collect(handle)
        np.testing.assert_array_equal(y, pool.compute(layer, x, ids, w))
        assert rel_fro(y, reference_ffn(layers[layer], x, ids, w)) < REL_TOL


def test_stats_count_bytes_jobs_and_reset(make_pool, pool_path):
    rng = rng_for("stats")
    pool = make_pool(make_layers(rng), threads=3)
    x, ids, w = make_inputs(rng, 1, [0, -1, 2])
    pool.compute(0, x, ids, w)
    stats = pool.stats
    # numpy: thread jobs cut by experts and rows; C: the layer job is one call, its threads inside it
    assert stats.calls == 1 and (stats.jobs == 1 if pool_path == "C" else stats.jobs > 3)
    assert stats.bytes_read == pool.store.nbytes(0, 0) + pool.store.nbytes(0, 2)
    assert stats.job_seconds > 0 and stats.wall_seconds > 0
    stats.reset()
    assert (stats.calls, stats.jobs, stats.bytes_read, stats.job_seconds) == (0, 0, 0, 0.0)


def test_bad_expert_id_names_layer(make_pool):
    rng = rng_for("bad-id")
    pool = make_pool(make_layers(rng), threads=1)
    x, _, w = make_inputs(rng, 1, [0])
    with pytest.raises(HostPoolError, match="layer 1 bad input"):
        pool.compute(1, x, np.array([E]), w)


@pytest.mark.parametrize("threads", [1, 3])
def test_raising_job_then_next_call_succeeds(make_pool, threads):
    rng = rng_for(f"raise-{threads}")
    layers = make_layers(rng)
    pool = make_pool(layers, threads=threads)
    x, ids, w = make_inputs(rng, 4, [3, 1])
    pool.inject_fault(1, "raise")
    with pytest.raises(HostPoolError, match=r"^host pool: layer 1 expert job failed: .*injected") as info:
        pool.compute(1, x, ids, w)
    assert info.value.layer == 1
    assert rel_fro(pool.compute(1, x, ids, w), reference_ffn(layers[1], x, ids, w)) < REL_TOL


@pytest.mark.parametrize("threads", [1, 3])
def test_hanging_job_times_out_then_next_call_succeeds(make_pool, threads):
    rng = rng_for(f"hang-{threads}")
    layers = make_layers(rng)
    before = _drivers()  # other pools of this process (the engines of other tests) keep theirs
    pool = make_pool(layers, threads=threads, timeout_s=0.5)
    x, ids, w = make_inputs(rng, 1, [2, -1, 4])
    pool.inject_fault(0, "hang")
    start = time.perf_counter()
    with pytest.raises(HostPoolError, match=r"^host pool: layer 0 did not answer within 0.5 s$") as info:
        pool.compute(0, x, ids, w)
    assert info.value.layer == 0
    assert time.perf_counter() - start < 2.0
    # The next call runs on fresh threads.
    assert rel_fro(pool.compute(0, x, ids, w), reference_ffn(layers[0], x, ids, w)) < REL_TOL
    # The abandoned generation's threads end (its driver was left waiting forever on cancelled thread jobs before,
    # and the process then hung at exit joining it): at most the fresh generation's driver is left.
    deadline = time.perf_counter() + 3.0
    while time.perf_counter() < deadline and _drivers() > before + 1:
        time.sleep(0.05)
    assert _drivers() <= before + 1


def test_a_timeout_while_jobs_are_queued_leaves_no_thread_behind(make_pool, monkeypatch):
    """A timeout that fires while thread jobs still wait in the queue (a callback timeout far below the job's
    time): the queued jobs are cancelled, and the driver waiting on them must end too. It used to wait forever on
    futures that a cancel never wakes, and the CLI then hung at exit joining it. The numpy / BLAS path, the one that
    queues a thread job per expert (the C kernel runs a layer job as one call, and finishes this one within the
    timeout on a fast machine)."""
    from strata_jax.host_pool import native
    monkeypatch.setenv(native.ENV, "0")
    rng = rng_for("queued-timeout")
    big = [tuple((0.1 * rng.standard_normal(shape)).astype(np.float32)
                 for shape in ((16, 512, 256), (16, 512, 256), (16, 256, 512)))]
    before = _drivers()
    for _ in range(3):
        pool = make_pool(big, threads=1, timeout_s=0.001)  # one worker: every other thread job queues
        ids = np.arange(16, dtype=np.int32)
        x = rng.standard_normal((8, 256)).astype(np.float32)
        w = rng.random((8, 16)).astype(np.float32)
        with pytest.raises(HostPoolError, match="did not answer"):
            pool.compute(0, x, ids, w)
        pool.close()
    deadline = time.perf_counter() + 5.0
    while time.perf_counter() < deadline and _drivers() > before:
        time.sleep(0.05)
    assert _drivers() <= before


def _drivers() -> int:
    import threading
    return sum(1 for t in threading.enumerate() if t.name.startswith("host-pool-driver") and t.is_alive())


@pytest.mark.parametrize("native_calls", [True, False], ids=["ffi", "io_callback"])
def test_bridge_inside_jit_matches_pool(make_pool, native_calls):
    """The graph reaches the pool by the native FFI call where it builds (else, and with native_calls=False, by
    io_callback): the same rows as the pool's own call, and the pool's counters see the graph's job."""
    from strata_jax.host_pool import bridge
    rng = rng_for("bridge")
    layers = make_layers(rng)
    pool = make_pool(layers, threads=3, native_calls=native_calls)
    if native_calls and pool.ffi_handle() is None:
        from strata_jax.host_pool import native
        pytest.skip(native.describe_ffi())
    assert bridge.native_calls(pool) == native_calls
    x, ids, w = make_inputs(rng, 4, [0, -1, 5, 2])

    @jax.jit
    def step(x, ids, w):
        return cpu_expert_rows(pool, 1, x.astype(jnp.bfloat16).astype(jnp.float32), ids, w) * 2.0

    x_rounded = x.astype(BF16).astype(np.float32)  # what the graph passes on
    pool.stats.reset()
    y = np.asarray(step(x, ids, w))
    assert pool.stats.calls == 1 and pool.stats.bytes_read == 3 * pool.store.nbytes(1, 0)
    np.testing.assert_allclose(y, 2.0 * pool.compute(1, x_rounded, ids, w), rtol=1e-6, atol=1e-6)
    assert rel_fro(y / 2.0, reference_ffn(layers[1], x_rounded, ids, w)) < REL_TOL


@pytest.mark.parametrize("cpu", [True, False], ids=["fetch_and_pool", "fetch_only"])
def test_offload_calls_fetch_into_slots_and_staging_and_compute(make_pool, cpu):
    """The native offload calls (bridge.offload_begin / offload_collect): each fetched expert's three matrices land in
    its victim slot row (fetch_dst >= 0) or in staging row n (-1), other slot rows keep their values, the pool's rows
    are the cpu experts' product, and the fetch counters count what was copied."""
    from strata_jax.host_pool import bridge
    rng = rng_for(f"offload-calls-{cpu}")
    layers = make_layers(rng)
    pool = make_pool(layers, threads=2, native_calls=True)
    if pool.ffi_handle() is None:
        from strata_jax.host_pool import native
        pytest.skip(native.describe_ffi())
    host = [tuple(jnp.asarray(a) for a in layer) for layer in layers]  # the experts where the fetch reads them
    for i, arrays in enumerate(host):
        pool.register_fetch(i, *(a.addressable_data(0).unsafe_buffer_pointer() for a in arrays))
    S = 3
    slots = tuple(jnp.asarray(rng.standard_normal((S + 1, *a.shape[1:])).astype(np.float32)) for a in layers[1])
    cpu_ids = np.array([0, -1, 5, -1], np.int32) if cpu else np.full(4, -1, np.int32)
    fetch_src = np.array([-1, 2, -1, 4], np.int32)
    fetch_dst = np.array([-1, 1, -1, -1], np.int32)  # expert 2 into slot 1; expert 4 into staging row 3
    x, _, w = make_inputs(rng, 3, cpu_ids)
    after = rng.standard_normal((3, H)).astype(np.float32)

    @jax.jit
    def window(x, w, slots, after):
        slots, stage, token = bridge.offload_begin(pool, 1, x, jnp.asarray(cpu_ids), w, jnp.asarray(fetch_src),
                                                   jnp.asarray(fetch_dst), slots, cpu)
        y = bridge.offload_collect(pool, 1, token, after) if cpu else jnp.zeros_like(after)
        return slots, stage, y

    before = pool.fetch_counters()
    worker_before = pool.worker_counters()
    pool.stats.reset()
    got_slots, stage, y = window(x, w, slots, after)
    for which in range(3):
        want = np.asarray(slots[which]).copy()
        want[1] = layers[1][which][2]
        np.testing.assert_array_equal(np.asarray(got_slots[which]), want)
        np.testing.assert_array_equal(np.asarray(stage[which])[3], layers[1][which][4])
    calls, experts, nbytes = (b - a for a, b in zip(before, pool.fetch_counters()))
    assert (calls, experts, nbytes) == (1, 2, 2 * sum(a[0].nbytes for a in layers[1]))
    # the CPU handlers run in place: no GPU worker took a job, and the job's own time is counted when there was one
    timeline = worker_timeline(worker_before, pool.worker_counters())
    assert (timeline["jobs"], timeline["gaps"], timeline["busy_us"], timeline["gap_us"]) == (0, 0, None, None)
    if cpu:
        assert pool.stats.calls == 1
        assert rel_fro(np.asarray(y), reference_ffn(layers[1], x, cpu_ids, w)) < REL_TOL
        assert pool.worker_counters()[4] > worker_before[4]
    else:
        assert pool.stats.calls == 0
        assert pool.worker_counters()[4] == worker_before[4]


def test_worker_timeline_means_between_two_readings():
    """The offload worker's means come from the difference of two counter readings (jobs, busy ns, gaps, gap ns,
    job ns), so an earlier request's jobs do not leak into the next one's figures."""
    before = (10, 5_000_000, 9, 1_000_000, 4_000_000)
    after = (14, 5_000_000 + 4 * 300_000, 12, 1_000_000 + 3 * 150_000, 4_000_000 + 4 * 250_000)
    got = worker_timeline(before, after)
    assert got == dict(jobs=4, gaps=3, busy_us=300.0, job_us=250.0, gap_us=150.0)
    assert worker_timeline(after, after) == dict(jobs=0, gaps=0, busy_us=None, job_us=None, gap_us=None)


def test_bridge_with_traced_layer(make_pool):
    rng = rng_for("bridge-traced-layer")
    layers = make_layers(rng)
    pool = make_pool(layers, threads=2)
    x, ids, w = make_inputs(rng, 1, [3])
    run = jax.jit(lambda layer, x, ids, w: cpu_expert_rows(pool, layer, x, ids, w))
    for layer in (0, 1):
        y = np.asarray(run(jnp.int32(layer), x, ids, w))
        assert rel_fro(y, reference_ffn(layers[layer], x, ids, w)) < REL_TOL


def test_bridge_error_unwraps_to_pool_error(make_pool):
    rng = rng_for("bridge-error")
    layers = make_layers(rng)
    pool = make_pool(layers, threads=2, native_calls=False)  # faults reach the io_callback path
    x, ids, w = make_inputs(rng, 4, [1, 4])
    run = jax.jit(lambda x, ids, w: cpu_expert_rows(pool, 1, x, ids, w))
    pool.inject_fault(1, "raise")
    with pytest.raises(Exception) as info:
        np.asarray(run(x, ids, w))  # raised at dispatch on CPU, at fetch on GPU
    assert not isinstance(info.value, HostPoolError)  # JAX wraps it
    error = unwrap_pool_error(info.value)
    assert isinstance(error, HostPoolError) and error.layer == 1
    assert str(error) == "host pool: layer 1 expert job failed: RuntimeError: injected fault"
    # The same jitted function works on the next call.
    assert rel_fro(np.asarray(run(x, ids, w)), reference_ffn(layers[1], x, ids, w)) < REL_TOL


def test_unwrap_ignores_other_errors():
    assert unwrap_pool_error(ValueError("something else")) is None
    direct = HostPoolError("host pool: layer 2 did not answer within 1.0 s", 2)
    assert unwrap_pool_error(direct) is direct
    try:
        try:
            raise direct
        except HostPoolError as inner:
            raise RuntimeError("wrapped") from inner
    except RuntimeError as outer:
        assert unwrap_pool_error(outer) is direct
