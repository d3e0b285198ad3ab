"""Host thread pool computing MoE experts that miss the GPU cache."""

from host_pool.blas import get_blas_threads, set_blas_threads
from host_pool.bridge import cpu_expert_rows, unwrap_pool_error
from host_pool.pool import HostPool, HostPoolError, PoolHandle, PoolStats
from host_pool.store import HostExpertStore

__all__ = ["HostExpertStore", "HostPool", "HostPoolError", "PoolHandle", "PoolStats",
           "cpu_expert_rows", "unwrap_pool_error", "get_blas_threads", "set_blas_threads"]
