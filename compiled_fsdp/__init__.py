"""compiled_fsdp: Fully Sharded Data Parallel whose collectives live in torch.compile graphs.

See README.md for usage and DESIGN.md for how the pieces fit: the layers
core <- runtime <- compile <- tools, and the passes, which import only the
core. This module is the facade over them: it wires the compile layer into
the runtime (``set_compiled_path``) and loads the tools when first used.
"""
import os as _os

from compiled_fsdp.core import compat as _compat

_compat.check_supported()  # an unsupported torch fails here, naming the range

from compiled_fsdp.compile.path import TorchCompilePath as _TorchCompilePath  # noqa: E402
from compiled_fsdp.core.comm import (  # noqa: E402
    collective_bytes,
    collective_counts,
    reset_collective_counts,
)
from compiled_fsdp.runtime.api import ShardingOptions, fully_shard  # noqa: E402
from compiled_fsdp.runtime.divergence import CollectiveMismatchError  # noqa: E402
from compiled_fsdp.runtime.extension import set_compiled_path as _set_compiled_path  # noqa: E402
from compiled_fsdp.runtime.module import (  # noqa: E402
    FSDPModule,
    GradientReductionHandle,
    UnshardHandle,
    register_fsdp_forward_method,
)
from compiled_fsdp.runtime.policy import (  # noqa: E402
    CPUOffloadPolicy,
    DataParallelMeshDims,
    MixedPrecisionPolicy,
    OffloadPolicy,
)
from compiled_fsdp.runtime.replicate import replicate  # noqa: E402
from compiled_fsdp.runtime.state import get_fsdp_state, iter_fsdp_states  # noqa: E402

__all__ = [
    "CPUOffloadPolicy",
    "CollectiveMismatchError",
    "DataParallelMeshDims",
    "GradientReductionHandle",
    "ModuleReport",
    "explain",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "UnshardHandle",
    "ShardingOptions",
    "collective_bytes",
    "collective_counts",
    "dump_graphs",
    "fully_shard",
    "get_fsdp_state",
    "iter_fsdp_states",
    "register_fsdp_forward_method",
    "replicate",
    "reset_collective_counts",
]

# The tools, loaded when first used (``import compiled_fsdp`` loads no tool and no pass).
_LAZY = {"ModuleReport": "explain", "explain": "explain", "dump_graphs": "debug"}


def __getattr__(name: str):  # noqa: ANN202 (PEP 562)
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"compiled_fsdp.tools.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'compiled_fsdp' has no attribute {name!r}")


def _dump_from_env() -> None:
    """``COMPILED_FSDP_DUMP=<dir>``: dump every graph from the first ``fully_shard`` on."""
    if _os.environ.get("COMPILED_FSDP_DUMP"):
        from compiled_fsdp.tools.debug import start_from_env

        start_from_env()


_path = _TorchCompilePath()
_path.on_fully_shard_hooks.append(_dump_from_env)
_set_compiled_path(_path)
