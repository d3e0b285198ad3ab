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
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from host_pool.pool import HostPool, HostPoolError

# Our messages are one line: "host pool: layer <n> <what happened>".
_POOL_MESSAGE = re.compile(r"host pool: layer (\d+) [^\n]*")


def cpu_expert_rows(pool: HostPool, layer, x, ids, w):
    """y [T, H] float32 = host pool result for x [T, H], ids [N] (-1 = padding), w [T, N].

    `layer` may be a Python int or a traced int scalar (e.g. inside a scan).
    Call inside jitted code; the pool runs on the host while the graph waits.
    """
    T, H = x.shape
    layer = jnp.asarray(layer, jnp.int32)

    def on_host(layer, x, ids, w):
        # Plain numpy only: calling JAX from here can deadlock the runtime.
        y = pool.compute(int(layer), np.asarray(x), np.asarray(ids), np.asarray(w))
        return np.asarray(y, np.float32)

    return io_callback(
        on_host, jax.ShapeDtypeStruct((T, H), jnp.float32),
        layer, x.astype(jnp.float32), ids.astype(jnp.int32), w.astype(jnp.float32),
        ordered=False)


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
            return HostPoolError(last.group(0).rstrip(), int(last.group(1)))
    return None
