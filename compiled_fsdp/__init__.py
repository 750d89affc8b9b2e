"""compiled_fsdp: Fully Sharded Data Parallel whose collectives live in torch.compile graphs.

See README.md for usage and DESIGN.md for how the pieces fit.
"""
from compiled_fsdp.core import compat as _compat

_compat.check_supported()  # an unsupported torch fails here, naming the range

from compiled_fsdp.runtime.api import ShardingOptions, fully_shard
from compiled_fsdp.runtime.divergence import CollectiveMismatchError
from compiled_fsdp.runtime.module import FSDPModule
from compiled_fsdp.runtime.policy import MixedPrecisionPolicy
from compiled_fsdp.tools.explain import ModuleReport, explain
from compiled_fsdp.runtime.collectives import collective_bytes, collective_counts, reset_collective_counts
from compiled_fsdp.tools.debug import dump_graphs
from compiled_fsdp.runtime.state import get_fsdp_state, iter_fsdp_states

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
