"""The native offload calls (bridge.offload_begin / offload_collect) with the layer as data: a traced int32 scalar
inside a lax.scan over layers (attribute layer=-1, the index at the end of the packed plan; native_ffi.cc).
The caller passes flat stacked slot arrays [L*(S+1), ...] and absolute destination rows l*(S+1)+slot. CPU
handlers, both the capture (_v2) and the sequence bindings."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import random_layers, reference_ffn, rel_fro, rng_for
from strata_jax.host_pool import bridge, native

L, E, H, I, S, T, N = 3, 6, 16, 8, 2, 3, 4
REL_TOL = 1e-5


@pytest.fixture(params=["capture", "sequence"])
def capture_env(request, monkeypatch):
    monkeypatch.setenv(native.CAPTURE_ENV, "1" if request.param == "capture" else "0")
    return request.param


def _pool(make_pool, rng, register=L):
    layers = random_layers(rng, np.float32, layers=L, e=E, h=H, i=I)
    pool = make_pool(layers, threads=2, native_calls=True)
    if pool.ffi_handle() is None:
        pytest.skip(native.describe_ffi())
    host = [tuple(jnp.asarray(a) for a in layer) for layer in layers]  # where the fetch reads; kept alive here
    for i, arrays in enumerate(host[:register]):
        pool.register_fetch(i, *(a.addressable_data(0).unsafe_buffer_pointer() for a in arrays))
    return layers, pool, host


def _plans(rng):
    """Per layer: x [T, H], cpu_ids [N], w [T, N], fetch_src [N], fetch_dst [N] (absolute rows of the flat slots or
    -1: staging), after [T, H]."""
    cpu_ids = np.array([[0, -1, 5, -1], [-1, 3, -1, 1], [2, -1, -1, 4]], np.int32)
    fetch_src = np.array([[-1, 2, -1, 4], [1, -1, 5, -1], [-1, 0, 3, -1]], np.int32)
    slot = np.array([[-1, 1, -1, -1], [0, -1, -1, -1], [-1, -1, 2, -1]], np.int32)  # -1: into staging row n
    fetch_dst = np.where(slot >= 0, slot + np.arange(L)[:, None] * (S + 1), -1).astype(np.int32)
    x = rng.standard_normal((L, T, H)).astype(np.float32)
    w = rng.random((L, T, N)).astype(np.float32)
    w *= (cpu_ids >= 0)[:, None, :]  # 0 where no cpu expert, as the graph gives it
    after = rng.standard_normal((L, T, H)).astype(np.float32)
    return x, cpu_ids, w, fetch_src, fetch_dst, after


def _flat_slots(rng, layers):
    return tuple(jnp.asarray(rng.standard_normal((L * (S + 1), *a.shape[1:])).astype(np.float32))
                 for a in layers[0])


def _scanned(pool, cpu):
    @jax.jit
    def run(slots, x, cpu_ids, w, fetch_src, fetch_dst, after):
        def step(slots, xs):
            layer, x, cpu_ids, w, fetch_src, fetch_dst, after = xs
            slots, stage, token = bridge.offload_begin(pool, layer, x, cpu_ids, w, fetch_src, fetch_dst, slots, cpu)
            y = bridge.offload_collect(pool, layer, token, after) if cpu else jnp.zeros_like(after)
            return slots, (y, stage)
        slots, (y, stage) = jax.lax.scan(step, slots, (jnp.arange(L, dtype=jnp.int32), x, cpu_ids, w, fetch_src,
                                                       fetch_dst, after))
        return slots, stage, y
    return run


def _unrolled(pool, cpu):
    @jax.jit
    def run(slots, x, cpu_ids, w, fetch_src, fetch_dst, after):
        ys, stages = [], []
        for layer in range(L):
            slots, stage, token = bridge.offload_begin(pool, layer, x[layer], cpu_ids[layer], w[layer],
                                                       fetch_src[layer], fetch_dst[layer], slots, cpu)
            ys.append(bridge.offload_collect(pool, layer, token, after[layer]) if cpu else jnp.zeros_like(after[0]))
            stages.append(stage)
        return slots, tuple(jnp.stack(s) for s in zip(*stages)), jnp.stack(ys)
    return run


@pytest.mark.parametrize("cpu", [True, False], ids=["fetch_and_pool", "fetch_only"])
def test_scan_over_layers_matches_reference_and_static_layers(make_pool, capture_env, cpu):
    rng = rng_for(f"offload-traced-{capture_env}-{cpu}")
    layers, pool, _host = _pool(make_pool, rng)
    plans = _plans(rng)
    x, cpu_ids, w, fetch_src, fetch_dst, after = plans
    slots = _flat_slots(rng, layers)
    want_slots = [np.asarray(a).copy() for a in slots]
    before = pool.fetch_counters()
    pool.stats.reset()
    got_slots, stage, y = _scanned(pool, cpu)(slots, *plans)
    calls, experts, nbytes = (b - a for a, b in zip(before, pool.fetch_counters()))
    fetched = int((fetch_src >= 0).sum())
    assert (calls, experts, nbytes) == (L, fetched, fetched * sum(a[0].nbytes for a in layers[0]))
    assert pool.stats.calls == (L if cpu else 0)
    for l in range(L):
        for m in range(N):
            if fetch_src[l, m] < 0:
                continue
            for k in range(3):
                expert = layers[l][k][fetch_src[l, m]]
                if fetch_dst[l, m] >= 0:
                    want_slots[k][fetch_dst[l, m]] = expert
                else:
                    np.testing.assert_array_equal(np.asarray(stage[k])[l, m], expert)
        if cpu:
            assert rel_fro(np.asarray(y[l]), reference_ffn(layers[l], x[l], cpu_ids[l], w[l])) < REL_TOL
    for k in range(3):
        np.testing.assert_array_equal(np.asarray(got_slots[k]), want_slots[k])

    # The same plans with a Python-int layer per layer (unrolled): bitwise the same.
    static_slots, static_stage, static_y = _unrolled(pool, cpu)(slots, *plans)
    np.testing.assert_array_equal(np.asarray(static_y), np.asarray(y))
    for k in range(3):
        np.testing.assert_array_equal(np.asarray(static_slots[k]), np.asarray(got_slots[k]))
        for l in range(L):  # staging rows are defined where fetched with dst -1
            rows = (fetch_src[l] >= 0) & (fetch_dst[l] < 0)
            np.testing.assert_array_equal(np.asarray(static_stage[k])[l][rows], np.asarray(stage[k])[l][rows])


def test_traced_layer_outside_the_store_is_an_error_not_a_hang(make_pool, capture_env):
    rng = rng_for(f"offload-traced-bad-{capture_env}")
    layers, pool, _host = _pool(make_pool, rng)
    x, cpu_ids, w, fetch_src, fetch_dst, after = _plans(rng)
    slots = _flat_slots(rng, layers)

    @jax.jit
    def one(layer, slots, x, cpu_ids, w, fetch_src, fetch_dst, after):
        slots, stage, token = bridge.offload_begin(pool, layer, x, cpu_ids, w, fetch_src, fetch_dst, slots, True)
        return slots, bridge.offload_collect(pool, layer, token, after)

    args = (slots, x[1], cpu_ids[1], w[1], fetch_src[1], fetch_dst[1], after[1])
    for bad in (L, -1, 1 << 20):
        with pytest.raises(Exception, match="the plan names layer"):
            jax.block_until_ready(one(jnp.int32(bad), *args))
    # the pool still answers a good index afterwards
    _, y = one(jnp.int32(1), *args)
    assert rel_fro(np.asarray(y), reference_ffn(layers[1], x[1], cpu_ids[1], w[1])) < REL_TOL


def test_traced_layer_wants_every_layer_registered(make_pool):
    rng = rng_for("offload-traced-unregistered")
    layers, pool, _host = _pool(make_pool, rng, register=L - 1)
    x, cpu_ids, w, fetch_src, fetch_dst, after = _plans(rng)
    slots = _flat_slots(rng, layers)
    run = jax.jit(lambda layer, slots: bridge.offload_begin(pool, layer, x[0], cpu_ids[0], w[0], fetch_src[0],
                                                            fetch_dst[0], slots, False)[0])
    with pytest.raises(Exception, match="every layer's"):
        jax.block_until_ready(run(jnp.int32(0), slots))


def test_layer_must_be_an_integer_scalar(make_pool):
    rng = rng_for("offload-traced-type")
    layers, pool, _host = _pool(make_pool, rng)
    x, cpu_ids, w, fetch_src, fetch_dst, after = _plans(rng)
    slots = _flat_slots(rng, layers)
    with pytest.raises(TypeError, match="integer scalar"):
        bridge.offload_begin(pool, jnp.float32(1), x[0], cpu_ids[0], w[0], fetch_src[0], fetch_dst[0], slots, True)
