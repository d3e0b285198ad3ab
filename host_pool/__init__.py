"""Host thread pool computing MoE experts that miss the GPU cache."""

from .blas import get_blas_threads, set_blas_threads
from .bridge import collect_cpu_rows, cpu_expert_rows, submit_cpu_rows, unwrap_pool_error, wait_heavy_rows
from .pool import HostPool, HostPoolError, PoolHandle, PoolStats, SplitJob
from .store import HostExpertStore

__all__ = ["HostExpertStore", "HostPool", "HostPoolError", "PoolHandle", "PoolStats", "SplitJob",
           "cpu_expert_rows", "submit_cpu_rows", "wait_heavy_rows", "collect_cpu_rows",
           "unwrap_pool_error", "get_blas_threads", "set_blas_threads"]
