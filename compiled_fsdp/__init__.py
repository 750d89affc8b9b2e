"""compiled_fsdp: Fully Sharded Data Parallel whose collectives live in torch.compile graphs.

See README.md for usage and DESIGN.md for how the pieces fit.
"""
from .core import compat as _compat

_compat.check_supported()  # an unsupported torch fails here, naming the range

from ._api import ShardingOptions, fully_shard
from ._divergence import CollectiveMismatchError
from ._module import FSDPModule
from ._policy import MixedPrecisionPolicy
from ._explain import ModuleReport, explain
from ._collectives import collective_bytes, collective_counts, reset_collective_counts
from ._debug import dump_graphs
from ._state import get_fsdp_state, iter_fsdp_states

__all__ = [
    "CollectiveMismatchError",
    "ModuleReport",
    "explain",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "ShardingOptions",
    "collective_bytes",
    "collective_counts",
    "dump_graphs",
    "fully_shard",
    "get_fsdp_state",
    "iter_fsdp_states",
    "reset_collective_counts",
]
