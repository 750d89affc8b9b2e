"""A compile region's call while Dynamo traces it: the block's forward between
its FSDP hooks, called directly. See [Note: A region's call under Dynamo]."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.nn.modules import module as _torch_module

from compiled_fsdp.compile.entry import CompiledEntry
from compiled_fsdp.core import compat
from compiled_fsdp.runtime.policy import cast_floating
from compiled_fsdp.runtime.state import FORWARD_HOOKS, get_fsdp_state

__all__ = ["prepare", "region_call"]


# [Note: A region's call under Dynamo]
# Dynamo inlines a call of a module with hooks through ``nn.Module.__call__``
# and ``_call_impl``: the checks of eight hook dicts, the loops over them,
# and each hook. A sharded block has three (``FSDPState``'s pre- and
# post-forward, ``_annotate_failed_forward``), which under Dynamo only cast
# the inputs and the output (``MixedPrecisionPolicy``): about 260 of the
# 760 instructions Dynamo traced around each block's region call in a
# whole-model compile. So a region class's ``__call__``, while Dynamo
# traces, casts as those hooks would and calls the block's forward itself
# (``_annotate_failed_forward`` does nothing under Dynamo) where the block
# has as many hooks as ``fully_shard`` registered (counted: ``FORWARD_HOOKS``
# in runtime/state.py) and no backward hook and no global hook. That is
# decided each step before tracing, in Python (``prepare``, from
# ``CompiledPath.on_step``): the entry's ``region_casts``, the hooks' casts
# (``FSDPState.forward_casts``) or None, is the one value the traced call
# reads, and Dynamo guards it. Checked in the traced code, the hook dicts
# cost 34 traced instructions and eight guards a block, and the hooks' casts
# 43 more (a per-block trace of 400 instructions at 8 blocks, 2026-12-04).
# A user's hook, forward or backward, registered before or after the first
# compile, makes it None: the call takes torch's path, and a hook added
# after the first compile recompiles the frame (the guard). A hook added
# while a step runs (by a hook of the root's, which runs after FSDP's
# pre-forward has prepared the step) is seen from the next step on. A class with a
# ``__call__`` or ``_call_impl`` of its own (an older transformers'
# checkpointing layer) keeps it: its region class gets no ``__call__``. Run
# as Python, the call is torch's, and Dynamo's frame evaluation runs it as
# Python (``compat.not_a_frame_itself``): compiled as a frame of its own (a
# root compiled in place calls its blocks as Python), the call traced the
# hooks, so the eager runtime never saw the block begin
# (tests/test_compile_in_place.py::test_root_compiled_in_place_with_accumulation
# found it). Tested by
# tests/test_region_variants.py::test_a_region_block_with_hooks_of_its_users
# (a user's hooks run, in order with FSDP's),
# tests/test_region_variants.py::test_hooks_of_a_users_added_after_the_first_step_run
# (they run from the step after, which recompiles once; the other blocks
# call their forward directly),
# tests/test_region_variants.py::test_a_region_block_with_a_call_of_its_own,
# tests/test_mixed_precision.py::test_inputs_and_outputs_are_cast (the
# pre-forward's cast of a region's input) and
# tests/test_block_regions.py::test_identical_blocks_compile_once.
def _only_fsdp_hooks(module: nn.Module) -> bool:
    return (len(module._forward_pre_hooks), len(module._forward_hooks)) == FORWARD_HOOKS and not (
        module._backward_pre_hooks or module._backward_hooks or _torch_module._global_forward_pre_hooks
        or _torch_module._global_forward_hooks or _torch_module._global_backward_pre_hooks
        or _torch_module._global_backward_hooks)


def prepare(entry: CompiledEntry) -> None:
    """Sets ``entry.region_casts`` for this step (the note above)."""
    module = entry.region_module()  # (set with ``in_region``, by ``make_region``)
    state = get_fsdp_state(module) if module is not None else None
    entry.region_casts = state.forward_casts() if state is not None and _only_fsdp_hooks(module) else None


def region_call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A region class's ``__call__`` (the note above)."""
    if torch.compiler.is_dynamo_compiling():
        casts = self.__dict__["_fsdp_region_entry"].region_casts
        if casts is not None:
            inputs, output = casts
            if inputs is not None:
                args, kwargs = cast_floating(inputs, (args, kwargs))
            out = self.forward(*args, **kwargs)
            return out if output is None else cast_floating(output, out)
    return nn.Module.__call__(self, *args, **kwargs)


compat.not_a_frame_itself(region_call)
