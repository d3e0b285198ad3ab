"""Lower a jitted function that calls Pallas kernels for CUDA on a machine without a GPU.

`interpret=True` on CPU does not check the Triton lowering rules (power-of-2 blocks, supported primitives). This
traces under an abstract mesh of an abstract H200 and runs the real CUDA lowering (no final compile), so CI catches
a kernel that cannot compile for the GPU.
"""
from __future__ import annotations

import jax
from jax._src.mesh import AbstractDevice, AbstractMesh
from jax.sharding import AxisType

DEVICE_KIND = "NVIDIA H200"  # maps to compute capability 9.0 in Pallas' Triton backend


def lower_for_cuda(fn, *args, device_kind: str = DEVICE_KIND, axis_type: AxisType = AxisType.Explicit) -> str:
    """fn: a Python function of arrays (it is jitted here); args: jax.ShapeDtypeStruct (or arrays, or pytrees of
    them) of its inputs. Returns the lowered StableHLO text (it embeds the Triton kernels); raises where a kernel
    cannot lower. axis_type: AxisType.Auto for a whole model graph (under Explicit, a padded product's update and
    operand carry different shardings)."""
    mesh = AbstractMesh((1,), ("x",), axis_types=(axis_type,),
                        abstract_device=AbstractDevice(device_kind=device_kind, num_cores=None, platform="cuda"))
    specs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), list(args))
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
