"""Call the host pool from inside jitted JAX code.

Errors: an exception raised inside the callback does not propagate as itself.
JAX logs it (logger "jax._src.callback", "jax.io_callback failed" + traceback)
and the computation fails with `jax.errors.JaxRuntimeError` (a RuntimeError;
XlaRuntimeError in older jax) whose text is
  "INTERNAL: CpuCallback error calling callback: Traceback ... \n
   HostPoolError: host pool: layer 3 did not answer within 20.0 s"
It is raised where the result is first needed: at the jitted call on CPU
(synchronous dispatch), at the result fetch / block_until_ready on GPU.
(GPU behaviour follows from async dispatch; only CPU is tested here.)
`unwrap_pool_error` turns it back into a HostPoolError for a one-line report;
to drop JAX's logged traceback too:
logging.getLogger("jax._src.callback").setLevel(logging.CRITICAL).

Split jobs (deferred CPU rows): `submit_cpu_rows` hands a layer's CPU entries
to the pool and returns a ticket at once; `wait_heavy_rows` blocks until the
heavy entries (weight >= threshold) are done; `collect_cpu_rows` blocks until
all are. Ordering: these callbacks are unordered (ordered=False), and XLA may
run an unordered callback as soon as its operands exist, in any order
relative to other work. So
  * the ticket operand is what orders wait/collect after submit;
  * nothing orders wait_heavy vs collect, nor places collect late by itself:
    a collect whose only operand is the ticket may run (and block the graph)
    right after submit. Pass `after=` (any jax array computed where collect
    should go, e.g. the next layer's attention output) to add a data
    dependency; it is handed to the callback and ignored.
  * Each ticket must be collected once; if the graph fails before its
    collect ran, `pool.drop_split_jobs()` forgets the leftovers.
Timeouts are the pool's `timeout_s`, counted from submit.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from . import native
from .pool import HostPool, HostPoolError

# Our messages are one line: "host pool: layer <n> <what happened>".
_POOL_MESSAGE = re.compile(r"host pool: layer (\d+) [^\n]*")
# A split job's phase: "host pool: layer <n> heavy|light rows ...".
_SPLIT_PHASE = re.compile(r"host pool: layer \d+ (heavy|light) rows ")


def native_calls(pool: HostPool) -> bool:
    """Whether `cpu_expert_rows` reaches this pool through the native FFI handler (no Python, no host round trip on
    a GPU; see HostPool.ffi_handle) rather than io_callback."""
    return pool.ffi_handle() is not None


def cpu_expert_rows(pool: HostPool, layer, x, ids, w):
    """y [T, H] float32 = host pool result for x [T, H], ids [N] (-1 = padding), w [T, N].

    `layer` may be a Python int or a traced int scalar (e.g. inside a scan; then always io_callback).
    Call inside jitted code; the pool runs on the host while the graph (its stream) waits. Where the pool has a
    native handle, one XLA FFI call (host_pool/native_ffi.cc) instead of io_callback: on a GPU the stream runs the
    copies and the job in order while the host thread that launches the graph goes on.
    """
    T, H = x.shape
    pool_id = pool.ffi_handle()
    if pool_id is not None and isinstance(layer, int):
        return jax.ffi.ffi_call(native.FFI_TARGET, jax.ShapeDtypeStruct((T, H), jnp.float32))(
            x.astype(jnp.float32), ids.astype(jnp.int32), w.astype(jnp.float32),
            pool=np.int64(pool_id), layer=np.int64(layer))
    layer = jnp.asarray(layer, jnp.int32)

    def on_host(layer, x, ids, w):
        # Plain numpy only: calling JAX from here can deadlock the runtime.
        y = pool.compute(int(layer), np.asarray(x), np.asarray(ids), np.asarray(w))
        return np.asarray(y, np.float32)

    return io_callback(
        on_host, jax.ShapeDtypeStruct((T, H), jnp.float32),
        layer, x.astype(jnp.float32), ids.astype(jnp.int32), w.astype(jnp.float32),
        ordered=False)


def _layer_attr(layer):
    """(the FFI attribute `layer`, the int32 [1] to append to the plan or None): a Python int is the attribute
    itself; a traced (or any jax / numpy array) scalar travels as data, the attribute -1 ("read it from the
    plan", native_ffi.cc), so one call serves every iteration of a lax.scan over layers."""
    if isinstance(layer, (int, np.integer)) and not isinstance(layer, bool):
        return int(layer), None
    layer = jnp.asarray(layer)
    if layer.shape != () or not jnp.issubdtype(layer.dtype, jnp.integer):
        raise TypeError(f"offload calls: layer must be a Python int or an integer scalar, not {layer.dtype}"
                        f"{list(layer.shape)}")
    return -1, layer.astype(jnp.int32).reshape(1)


def offload_begin(pool: HostPool, layer, x, cpu_ids, cpu_w, fetch_src, fetch_dst, slots: tuple, cpu: bool):
    """One offloaded layer's start, one FFI call (native_ffi.cc strata_offload_begin): the fetched experts copied
    from pinned host memory, and the cpu experts handed to the pool, which computes them while the graph goes on.
    x [T, H]; cpu_ids [N] (-1: not a cpu expert) and cpu_w [T, N] as `cpu_expert_rows` takes them; fetch_src [N]
    expert ids to fetch (-1: none) and fetch_dst [N] each one's slot row, or -1: into staging row n instead;
    slots (gate, up, down) [S+1, ...]. Returns (the slots after the fetch: the same buffers, aliased; the staging
    rows (gate, up, down) [N, ...], valid where fetched with fetch_dst -1; a token for `offload_collect`).
    cpu: whether this graph has a cpu part (static). The layer's pinned experts are registered
    (HostPool.register_fetch).
    layer: a Python int, or a traced integer scalar (a lax.scan over layers). Traced, the index rides at the end of
    the plan and the handler reads it (attribute layer=-1); fetch_dst rows are rows of the arrays given, so the
    caller passes flat stacks [L*(S+1), ...] and absolute rows l*(S+1)+slot; every layer's experts must be
    registered and share H. Each traced begin with cpu wants its traced collect before the next traced begin."""
    T, H = x.shape
    N, M = cpu_ids.shape[0], fetch_src.shape[0]
    assert M == N, "fetch_src is by window position"  # also: the capture path's collect finds its staging by N
    layer, traced = _layer_attr(layer)
    ints = jnp.concatenate([cpu_ids.astype(jnp.int32), fetch_src.astype(jnp.int32), fetch_dst.astype(jnp.int32)]
                           + ([] if traced is None else [traced]))  # traced: the layer last (native_ffi.cc)
    packed = jnp.concatenate([x.astype(jnp.float32).reshape(-1), cpu_w.astype(jnp.float32).reshape(-1),
                              jax.lax.bitcast_convert_type(ints, jnp.float32)])
    out = jax.ffi.ffi_call(
        native.OFFLOAD_BEGIN_CAPTURE if native.offload_capture() else native.OFFLOAD_BEGIN,
        tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in slots)
        + tuple(jax.ShapeDtypeStruct((N, *a.shape[1:]), a.dtype) for a in slots)
        + (jax.ShapeDtypeStruct((N,), jnp.int32),),  # the token: [N], so that collect knows N statically
        input_output_aliases={1: 0, 2: 1, 3: 2})(
        packed, *slots, pool=np.int64(pool.ffi_handle()), layer=np.int64(layer), tokens=np.int64(T),
        n=np.int64(N), m=np.int64(M), cpu=np.int64(cpu), fetch=np.int64(1))
    return tuple(out[:3]), tuple(out[3:6]), out[6]


def offload_collect(pool: HostPool, layer, token, after):
    """The cpu experts' rows [T, H] float32 of the layer's last `offload_begin` (one with cpu=True; each such begin
    wants exactly one collect before the layer's next begin); `after` [T, H] float32 (the GPU experts' rows) only
    orders it: the stream waits for the pool after the GPU's own experts.
    The capture path (native.offload_capture(), the default) takes the window's N from the token's shape: its
    handler finds the begin's staging from (layer, T, N) itself, so the call is the same at every execution and
    XLA records it into its command buffers.
    layer: as offload_begin's; traced, this collects the last traced begin (attribute layer=-1: the traced slot),
    whichever index it carried, so the value itself is not used here."""
    layer, _ = _layer_attr(layer)
    result = jax.ShapeDtypeStruct(after.shape, jnp.float32)
    if native.offload_capture():
        return jax.ffi.ffi_call(native.OFFLOAD_COLLECT_CAPTURE, result)(
            token, after.astype(jnp.float32), pool=np.int64(pool.ffi_handle()), layer=np.int64(layer),
            n=np.int64(token.shape[0]))
    return jax.ffi.ffi_call(native.OFFLOAD_COLLECT, result)(
        token, after.astype(jnp.float32), pool=np.int64(pool.ffi_handle()), layer=np.int64(layer))


def offload_prefetch(pool: HostPool, layer, src, dst, slots: tuple) -> tuple:
    """The prefetch of one layer's experts (native_ffi.cc strata_offload_prefetch): src [M] expert ids of `layer`
    (-1: none), dst [M] each one's row of the slot arrays (absolute: flat stacks take l*(S+1)+slot; wanted >= 0
    where src is), slots (gate, up, down) [rows, ...]. Returns the slot arrays, the same buffers (aliased). On a GPU
    the copies run on a side stream behind the graph's stream, and the next prefetch call joins them (the graph's
    stream waits) before anything after it: so call it once per layer, before that layer's begin, with M = 0 rows
    (or every src -1) where there is nothing to prefetch. layer: as offload_begin's (traced: the index last in the
    plan). On the CPU the rows are copied when the call runs."""
    M = src.shape[0]
    layer, traced = _layer_attr(layer)
    packed = jnp.concatenate([src.astype(jnp.int32), dst.astype(jnp.int32)] + ([] if traced is None else [traced]))
    out = jax.ffi.ffi_call(
        native.OFFLOAD_PREFETCH, tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in slots),
        input_output_aliases={1: 0, 2: 1, 3: 2}, has_side_effect=True)(
        packed, *slots, pool=np.int64(pool.ffi_handle()), layer=np.int64(layer), m=np.int64(M),
        capture=np.int64(native.offload_capture()))
    return tuple(out)


def submit_cpu_rows(pool: HostPool, layer, x, ids, weights, threshold):
    """Ticket (int32 scalar) of a split job for x [T, H], ids [T, K] (-1 = not
    a CPU entry), weights [T, K]; see `HostPool.submit_split`. The callback
    returns at once: the graph does not wait for the compute. `layer` and
    `threshold` may be Python numbers or traced scalars."""
    layer = jnp.asarray(layer, jnp.int32)
    threshold = jnp.asarray(threshold, jnp.float32)

    def on_host(layer, x, ids, weights, threshold):
        ticket = pool.submit_split(int(layer), np.asarray(x), np.asarray(ids),
                                   np.asarray(weights), float(threshold))
        return np.int32(ticket)

    return io_callback(
        on_host, jax.ShapeDtypeStruct((), jnp.int32),
        layer, x.astype(jnp.float32), ids.astype(jnp.int32), weights.astype(jnp.float32),
        threshold, ordered=False)


def wait_heavy_rows(pool: HostPool, ticket, T: int, K: int, H: int, after=None):
    """rows [T, K, H] float32, unweighted, heavy entries filled, others zero;
    blocks until the ticket's heavy phase is done (`HostPool.wait_heavy`).
    `after`: optional jax array, passed along and ignored (see module doc)."""
    return _split_callback(pool.wait_heavy, ticket, (T, K, H), after)


def collect_cpu_rows(pool: HostPool, ticket, T: int, K: int, H: int, after=None):
    """rows [T, K, H] float32, unweighted, every entry filled; blocks until the
    ticket's job is done and forgets the ticket (`HostPool.collect_split`).
    `after`: optional jax array, passed along and ignored: collect cannot run
    before it exists (see module doc)."""
    return _split_callback(pool.collect_split, ticket, (T, K, H), after)


def _split_callback(method, ticket, shape, after):
    def on_host(ticket, *after):
        del after  # only a data dependency
        return np.asarray(method(int(ticket)), np.float32)

    extra = () if after is None else (after,)
    return io_callback(on_host, jax.ShapeDtypeStruct(shape, jnp.float32),
                       jnp.asarray(ticket, jnp.int32), *extra, ordered=False)


def unwrap_pool_error(exc: BaseException) -> HostPoolError | None:
    """The HostPoolError behind `exc` (itself, a chained cause, or our message
    inside a JAX runtime error's text), or None if it is not ours."""
    chain = []
    while exc is not None and all(exc is not seen for seen in chain):
        if isinstance(exc, HostPoolError):
            return exc
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    for error in chain:
        matches = list(_POOL_MESSAGE.finditer(str(error)))
        if matches:
            last = matches[-1]  # the traceback ends with the raised message
            phase = _SPLIT_PHASE.match(last.group(0))
            return HostPoolError(last.group(0).rstrip(), int(last.group(1)),
                                 phase.group(1) if phase else None)
    return None
