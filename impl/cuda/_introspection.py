"""What a captured CUDA graph holds, read from the driver: its work nodes and their kernels'
names (``graph_node_count``, ``graph_op_names``)."""


from __future__ import annotations

from typing import Any

from ._bindings import _code, _cuda_driver

__all__: list[str] = []

def _kernel_name(node: Any) -> str | None:
    drv = _cuda_driver()
    if drv is None:
        return None
    try:
        err, params = drv.cuGraphKernelNodeGetParams(drv.CUgraphNode(init_value=int(node)))
        if _code(err) != 0 or not int(params.func):
            return None
        err, name = drv.cuFuncGetName(drv.CUfunction(init_value=int(params.func)))
        if _code(err) != 0:
            return None
    except Exception:
        return None
    return name.decode() if isinstance(name, bytes) else str(name)


