"""Host pool split jobs (deferred CPU rows): per-entry unweighted rows [T, K, H],
heavy entries (weight >= threshold) first with a signal, then the light ones;
the ticket registry, phase-naming errors and the jitted io_callback bridge.

Tolerance: rel error < 1e-5 per entry against a float64 numpy reference, and
for the weighted sum against the existing one-pass `HostPool.compute`.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import random_layers, reference_rows, rel_fro, rng_for
from strata_jax.host_pool import HostPoolError, collect_cpu_rows, submit_cpu_rows, unwrap_pool_error, wait_heavy_rows
from strata_jax.host_pool.store import BF16

LAYERS, E, H, I = 2, 8, 64, 32
REL_TOL = 1e-5
THRESHOLD = 0.5


def make_layers(rng, dtype=np.float32):
    """Per layer (gate [E, I, H], up [E, I, H], down [E, H, I]) at this file's sizes."""
    return random_layers(rng, dtype, layers=LAYERS, e=E, h=H, i=I)


def make_inputs(rng, T, K):
    """x [T, H], ids [T, K] with some -1 and experts shared between tokens,
    weights [T, K] in (0, 1) with both heavy and light entries."""
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int32)
    if T > 1:
        ids[1, 0] = ids[0, 0]  # one expert, two tokens
    ids[0, -1] = -1            # not a CPU entry
    w = rng.uniform(0.05, 0.95, (T, K)).astype(np.float32)
    w[0, 0], w[-1, 1 % K] = 0.9, 0.1  # at least one heavy and (if K > 1) one light entry
    return x, ids, w


def assert_rows_close(rows, ref, ids):
    assert rows.dtype == np.float32 and rows.shape == ref.shape
    for t, k in zip(*np.nonzero(ids >= 0)):
        assert rel_fro(rows[t, k], ref[t, k]) < REL_TOL, (t, k)
    np.testing.assert_array_equal(rows[ids < 0], 0.0)


def heavy_mask(ids, w, threshold):
    return (ids >= 0) & (w >= np.float32(threshold))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("T,K", [(1, 1), (1, 4), (4, 4)])
def test_split_rows_match_reference(make_pool, pool_path, dtype, threads, T, K):
    rng = rng_for(f"split-ref-{dtype}-{threads}-{T}-{K}")
    layers = make_layers(rng, BF16 if dtype == "bfloat16" else np.float32)
    pool = make_pool(layers, threads=threads)
    x, ids, w = make_inputs(rng, T, K)
    ticket = pool.submit_split(1, x, ids, w, THRESHOLD)
    heavy_rows = pool.wait_heavy(ticket).copy()
    rows = pool.collect_split(ticket)
    ref = reference_rows(layers[1], x, ids)
    assert_rows_close(rows, ref, ids)
    heavy = heavy_mask(ids, w, THRESHOLD)
    np.testing.assert_array_equal(heavy_rows[heavy], rows[heavy])  # same bits
    np.testing.assert_array_equal(heavy_rows[~heavy], 0.0)
    assert pool.split_tickets() == []


@pytest.mark.parametrize("threads", [1, 3])
def test_weighted_sum_matches_one_pass_compute(make_pool, threads):
    rng = rng_for(f"split-sum-{threads}")
    layers = make_layers(rng)
    pool = make_pool(layers, threads=threads)
    T, K = 4, 4
    x, ids, w = make_inputs(rng, T, K)
    rows = pool.compute_split(0, x, ids, w, THRESHOLD)
    y_split = np.einsum("tk,tkh->th", np.where(ids >= 0, w, 0.0), rows)
    # The same entries for the one-pass API: ids [T*K], w [T, T*K] block-diagonal.
    w_one_pass = np.zeros((T, T * K), np.float32)
    for t in range(T):
        w_one_pass[t, t * K:(t + 1) * K] = w[t]
    y_one_pass = pool.compute(0, x, ids.reshape(-1), w_one_pass)
    assert rel_fro(y_split, y_one_pass) < REL_TOL


def test_threshold_edges(make_pool):
    rng = rng_for("split-threshold")
    layers = make_layers(rng)
    pool = make_pool(layers, threads=2)
    x, ids, w = make_inputs(rng, 4, 3)
    ref = reference_rows(layers[0], x, ids)
    valid = ids >= 0

    # 0.0: every entry heavy.
    ticket = pool.submit_split(0, x, ids, w, 0.0)
    heavy_rows = pool.wait_heavy(ticket).copy()
    assert_rows_close(heavy_rows, ref, ids)
    np.testing.assert_array_equal(pool.collect_split(ticket), heavy_rows)

    # Above every weight: every entry light.
    ticket = pool.submit_split(0, x, ids, w, 1.5)
    np.testing.assert_array_equal(pool.wait_heavy(ticket), 0.0)
    assert_rows_close(pool.collect_split(ticket), ref, ids)

    # A weight equal to the threshold is heavy, the next float32 below is light.
    w = w.copy()
    w[1, 1] = np.float32(0.375)
    w[2, 1] = np.nextafter(np.float32(0.375), np.float32(0.0))
    ticket = pool.submit_split(0, x, ids, w, 0.375)
    heavy_rows = pool.wait_heavy(ticket).copy()
    rows = pool.collect_split(ticket)
    heavy = valid & (w >= np.float32(0.375))
    assert heavy[1, 1] and not heavy[2, 1]
    assert np.all(heavy_rows[1, 1] != 0.0) and np.all(heavy_rows[2, 1] == 0.0)
    np.testing.assert_array_equal(heavy_rows[heavy], rows[heavy])
    np.testing.assert_array_equal(heavy_rows[~heavy], 0.0)
    assert_rows_close(rows, ref, ids)


def test_all_entries_missing_gives_zeros(make_pool):
    rng = rng_for("split-empty")
    pool = make_pool(make_layers(rng), threads=2)
    x, _, w = make_inputs(rng, 2, 3)
    ids = np.full((2, 3), -1, np.int32)
    ticket = pool.submit_split(0, x, ids, w, THRESHOLD)
    np.testing.assert_array_equal(pool.wait_heavy(ticket), 0.0)
    np.testing.assert_array_equal(pool.collect_split(ticket), np.zeros((2, 3, H), np.float32))


def test_weights_read_once_per_expert_and_phase(make_pool, pool_path):
    rng = rng_for("split-bytes")
    layers = make_layers(rng)
    pool = make_pool(layers, threads=3)
    x = rng.standard_normal((4, H)).astype(np.float32)
    ids = np.array([[1, 2], [1, 2], [1, 3], [2, -1]], np.int32)
    w = np.array([[0.8, 0.2], [0.7, 0.3], [0.6, 0.1], [0.9, 0.4]], np.float32)
    # heavy: expert 1 (3 entries), 2 (1 entry); light: expert 2 (2), 3 (1).
    pool.compute_split(1, x, ids, w, THRESHOLD)
    nbytes = pool.store.nbytes
    assert pool.stats.bytes_read == nbytes(1, 1) + 2 * nbytes(1, 2) + nbytes(1, 3)
    # numpy: thread jobs cut by experts and rows; C: one call per phase
    assert pool.stats.calls == 1 and (pool.stats.jobs == 2 if pool_path == "C" else pool.stats.jobs > 4)


def test_tickets_in_flight_collected_in_any_order(make_pool):
    rng = rng_for("split-tickets")
    layers = make_layers(rng)
    pool = make_pool(layers, threads=3)
    jobs = [(layer, *make_inputs(rng, 3, 2)) for layer in (0, 1, 0)]
    tickets = [pool.submit_split(layer, x, ids, w, THRESHOLD) for layer, x, ids, w in jobs]
    assert len(set(tickets)) == 3 and all(isinstance(t, int) and 0 < t < 2**31 for t in tickets)
    assert sorted(pool.split_tickets()) == sorted(tickets)
    for ticket, (layer, x, ids, _) in reversed(list(zip(tickets, jobs))):
        assert_rows_close(pool.collect_split(ticket), reference_rows(layers[layer], x, ids), ids)
    assert pool.split_tickets() == []
    with pytest.raises(HostPoolError, match=f"unknown split job ticket {tickets[0]}"):
        pool.collect_split(tickets[0])


def test_bad_input_names_layer(make_pool):
    rng = rng_for("split-bad")
    pool = make_pool(make_layers(rng), threads=1)
    x, ids, w = make_inputs(rng, 2, 2)
    with pytest.raises(HostPoolError, match="^host pool: layer 1 bad input"):
        pool.submit_split(1, x, ids, w[:, :1], THRESHOLD)
    with pytest.raises(HostPoolError, match="^host pool: layer 0 bad input: expert ids"):
        pool.submit_split(0, x, np.full_like(ids, E), w, THRESHOLD)
    assert pool.split_tickets() == []


def test_light_phase_stuck_heavy_still_arrives(make_pool):
    rng = rng_for("split-light-hang")
    layers = make_layers(rng)
    pool = make_pool(layers, threads=2, timeout_s=1.0)
    x, ids, w = make_inputs(rng, 4, 4)
    ref = reference_rows(layers[0], x, ids)
    heavy = heavy_mask(ids, w, THRESHOLD)
    pool.inject_fault(0, "hang", phase="light")
    start = time.perf_counter()
    ticket = pool.submit_split(0, x, ids, w, THRESHOLD)
    heavy_rows = pool.wait_heavy(ticket).copy()  # would raise at the 1 s deadline if not signalled
    assert time.perf_counter() - start < 1.0
    for t, k in zip(*np.nonzero(heavy)):
        assert rel_fro(heavy_rows[t, k], ref[t, k]) < REL_TOL
    np.testing.assert_array_equal(heavy_rows[~heavy], 0.0)
    with pytest.raises(HostPoolError) as info:
        pool.collect_split(ticket)
    assert str(info.value) == "host pool: layer 0 light rows did not arrive within 1.0 s"
    assert (info.value.layer, info.value.phase) == (0, "light")
    assert time.perf_counter() - start < 3.0
    assert pool.split_tickets() == []
    # Usable afterwards, split and plain jobs alike.
    assert_rows_close(pool.compute_split(0, x, ids, w, THRESHOLD), ref, ids)
    assert pool.compute(0, x[:1], ids[0], w[:1]).shape == (1, H)


def test_heavy_phase_stuck(make_pool):
    rng = rng_for("split-heavy-hang")
    layers = make_layers(rng)
    pool = make_pool(layers, threads=2, timeout_s=0.5)
    x, ids, w = make_inputs(rng, 2, 3)
    pool.inject_fault(1, "hang", phase="heavy")
    ticket = pool.submit_split(1, x, ids, w, THRESHOLD)
    with pytest.raises(HostPoolError) as info:
        pool.wait_heavy(ticket)
    assert str(info.value) == "host pool: layer 1 heavy rows did not arrive within 0.5 s"
    assert (info.value.layer, info.value.phase) == (1, "heavy")
    # The abandoned job ends in its heavy phase; collect reports that and forgets the ticket.
    with pytest.raises(HostPoolError, match="^host pool: layer 1 heavy rows") as info:
        pool.collect_split(ticket)
    assert info.value.phase == "heavy" and pool.split_tickets() == []
    # Without wait_heavy, collect names the phase still running, with an explicit timeout.
    pool.inject_fault(1, "hang", phase="heavy")
    ticket = pool.submit_split(1, x, ids, w, THRESHOLD)
    with pytest.raises(HostPoolError) as info:
        pool.collect_split(ticket, timeout=0.2)
    assert str(info.value) == "host pool: layer 1 heavy rows did not arrive within 0.2 s"
    assert_rows_close(pool.compute_split(1, x, ids, w, THRESHOLD), reference_rows(layers[1], x, ids), ids)


@pytest.mark.parametrize("threshold", [THRESHOLD, 1.5])  # 1.5: the heavy phase is empty
def test_raising_phases_name_phase_then_next_call_succeeds(make_pool, threshold):
    rng = rng_for(f"split-raise-{threshold}")
    layers = make_layers(rng)
    pool = make_pool(layers, threads=3)
    x, ids, w = make_inputs(rng, 4, 2)
    ref = reference_rows(layers[1], x, ids)

    pool.inject_fault(1, "raise", phase="light")
    ticket = pool.submit_split(1, x, ids, w, threshold)
    pool.wait_heavy(ticket)  # heavy phase is fine
    with pytest.raises(HostPoolError) as info:
        pool.collect_split(ticket)
    assert str(info.value) == "host pool: layer 1 light rows failed: RuntimeError: injected fault"
    assert (info.value.layer, info.value.phase) == (1, "light")

    pool.inject_fault(1, "raise", phase="heavy")
    ticket = pool.submit_split(1, x, ids, w, threshold)
    for wait in (pool.wait_heavy, pool.collect_split):
        with pytest.raises(HostPoolError) as info:
            wait(ticket)
        assert str(info.value) == "host pool: layer 1 heavy rows failed: RuntimeError: injected fault"
        assert info.value.phase == "heavy"

    assert pool.split_tickets() == []
    assert_rows_close(pool.compute_split(1, x, ids, w, threshold), ref, ids)


def test_plain_fault_does_not_hit_split_jobs(make_pool):
    rng = rng_for("split-plain-fault")
    layers = make_layers(rng)
    pool = make_pool(layers, threads=2)
    x, ids, w = make_inputs(rng, 2, 2)
    pool.inject_fault(0, "raise")  # for the next plain job only
    assert_rows_close(pool.compute_split(0, x, ids, w, THRESHOLD), reference_rows(layers[0], x, ids), ids)
    with pytest.raises(HostPoolError, match="layer 0 expert job failed"):
        pool.compute(0, x[:1], ids[0], w[:1])


def split_step(pool, T, K):
    """Jitted: submit -> wait_heavy -> collect (placed after the heavy rows are used)."""

    @jax.jit
    def step(layer, x, ids, w, threshold):
        ticket = submit_cpu_rows(pool, layer, x, ids, w, threshold)
        heavy_rows = wait_heavy_rows(pool, ticket, T, K, H)
        y_heavy = jnp.einsum("tk,tkh->th", jnp.where(ids >= 0, w, 0.0), heavy_rows)
        rows = collect_cpu_rows(pool, ticket, T, K, H, after=y_heavy)
        return heavy_rows, rows, y_heavy

    return step


def test_bridge_inside_jit_matches_direct_api(make_pool):
    rng = rng_for("split-bridge")
    layers = make_layers(rng)
    pool = make_pool(layers, threads=3)
    T, K = 4, 3
    x, ids, w = make_inputs(rng, T, K)
    step = split_step(pool, T, K)
    heavy = heavy_mask(ids, w, THRESHOLD)
    for layer in (1, 0):  # traced layer: one compile
        heavy_rows, rows, y_heavy = map(np.asarray, step(jnp.int32(layer), x, ids, w, jnp.float32(THRESHOLD)))
        ticket = pool.submit_split(layer, x, ids, w, THRESHOLD)
        direct_heavy = pool.wait_heavy(ticket).copy()
        direct_rows = pool.collect_split(ticket)
        np.testing.assert_allclose(heavy_rows, direct_heavy, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(rows, direct_rows, rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(heavy_rows[~heavy], 0.0)
        assert_rows_close(rows, reference_rows(layers[layer], x, ids), ids)
        np.testing.assert_allclose(
            y_heavy, np.einsum("tk,tkh->th", np.where(heavy, w, 0.0), direct_rows), rtol=1e-5, atol=1e-6)
    assert pool.split_tickets() == []


@pytest.mark.parametrize("phase", ["light", "heavy"])
def test_bridge_error_unwraps_to_phase_error(make_pool, phase):
    rng = rng_for(f"split-bridge-error-{phase}")
    layers = make_layers(rng)
    pool = make_pool(layers, threads=2)
    T, K = 2, 2
    x, ids, w = make_inputs(rng, T, K)
    step = split_step(pool, T, K)
    pool.inject_fault(1, "raise", phase=phase)
    with pytest.raises(Exception) as info:
        jax.block_until_ready(step(jnp.int32(1), x, ids, w, jnp.float32(THRESHOLD)))
    assert not isinstance(info.value, HostPoolError)  # JAX wraps it
    error = unwrap_pool_error(info.value)
    assert isinstance(error, HostPoolError)
    assert str(error) == f"host pool: layer 1 {phase} rows failed: RuntimeError: injected fault"
    assert (error.layer, error.phase) == (1, phase)
    pool.drop_split_jobs()  # a failed graph may leave its ticket uncollected
    # The same jitted function works on the next call.
    _, rows, _ = step(jnp.int32(1), x, ids, w, jnp.float32(THRESHOLD))
    assert_rows_close(np.asarray(rows), reference_rows(layers[1], x, ids), ids)
    assert pool.split_tickets() == []


def test_bridge_submit_and_wait_heavy_do_not_wait_for_light_phase(make_pool):
    rng = rng_for("split-bridge-async")
    layers = make_layers(rng)
    pool = make_pool(layers, threads=2, timeout_s=1.0)
    T, K = 3, 2
    x, ids, w = make_inputs(rng, T, K)

    @jax.jit
    def start(x, ids, w):
        ticket = submit_cpu_rows(pool, 0, x, ids, w, THRESHOLD)
        return ticket, wait_heavy_rows(pool, ticket, T, K, H)

    pool.inject_fault(0, "hang", phase="light")
    # Returns although the light phase is stuck (the jitted call would fail at the deadline otherwise).
    ticket, heavy_rows = jax.block_until_ready(start(x, ids, w))
    assert int(ticket) in pool.split_tickets()
    heavy = heavy_mask(ids, w, THRESHOLD)
    ref = reference_rows(layers[0], x, ids)
    for t, k in zip(*np.nonzero(heavy)):
        assert rel_fro(np.asarray(heavy_rows)[t, k], ref[t, k]) < REL_TOL
    with pytest.raises(HostPoolError, match="^host pool: layer 0 light rows did not arrive within 1.0 s$"):
        pool.collect_split(int(ticket))
