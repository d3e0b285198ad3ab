"""Host thread pool computing MoE experts that miss the GPU cache."""

from host_pool.blas import get_blas_threads, set_blas_threads
from host_pool.bridge import (collect_cpu_rows, cpu_expert_rows, submit_cpu_rows,
                              unwrap_pool_error, wait_heavy_rows)
from host_pool.pool import HostPool, HostPoolError, PoolHandle, PoolStats, SplitJob
from host_pool.store import HostExpertStore

__all__ = ["HostExpertStore", "HostPool", "HostPoolError", "PoolHandle", "PoolStats", "SplitJob",
           "cpu_expert_rows", "submit_cpu_rows", "wait_heavy_rows", "collect_cpu_rows",
           "unwrap_pool_error", "get_blas_threads", "set_blas_threads"]
