"""One schema per compile region in a trace.

[Note: One schema per region]
Under autograd, torch runs a higher-order op's ``gen_schema`` at every call
of it (``HigherOrderOperator``'s autograd kernel, in every release
2.11-2.15), only to refuse a subgraph that writes its inputs. For
``invoke_subgraph`` that means tracing the region's body again with
``make_fx`` and walking the result for mutations and aliases: twice for
every block that calls a region while AOTAutograd traces the outer graph (its
metadata pass and its joint trace). That is torch's cost for its own regions
as much as for ours, and at 32 GPT blocks it was about a sixth of a cold
first step on the CPU (RESULTS, "One schema per region").

The answer depends on the subgraph alone: a region's ``GraphModule`` has no
control flow, so the same graph called on operands of the same types, shapes,
strides and ``requires_grad`` has the same schema. ``memoize_region_schemas``
keeps each answer for the rest of the compile window
([Note: Passes installed while compiling] in install.py) and gives it again
for the same graph object, identifier and operands: a region's first call
still runs torch's check, so a region that writes its inputs is refused as
before. The memo holds the graphs it keys on, so no id is reused while it
lives; it goes, and torch's own method is back, when the window closes. A
subgraph that is not a ``GraphModule`` (a Python function) is passed
through. Tested: tests/test_block_regions.py::test_one_schema_per_region.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import fx


def _operand_key(operand: Any) -> tuple:
    if isinstance(operand, torch.Tensor):
        return (type(operand), operand.dtype, operand.device, operand.requires_grad,
                tuple(map(str, operand.shape)), tuple(map(str, operand.stride())))
    return (type(operand), str(operand))


def memoize_region_schemas() -> Callable[[], None]:
    """Shadows ``invoke_subgraph.gen_schema`` with a memo of its answers, see
    the note; returns what puts torch's method back."""
    from torch._higher_order_ops.invoke_subgraph import invoke_subgraph

    if "gen_schema" in vars(invoke_subgraph):  # (a memo is in place already)
        return lambda: None
    original = invoke_subgraph.gen_schema
    memo: dict[tuple, tuple[fx.GraphModule, Any]] = {}

    def gen_schema(subgraph: Any, identifier: Any, *operands: Any) -> Any:
        if not isinstance(subgraph, fx.GraphModule):
            return original(subgraph, identifier, *operands)
        key = (id(subgraph), identifier, tuple(map(_operand_key, operands)))
        known = memo.get(key)
        if known is not None and known[0] is subgraph:
            return known[1]
        schema = original(subgraph, identifier, *operands)
        memo[key] = (subgraph, schema)
        return schema

    invoke_subgraph.gen_schema = gen_schema

    def restore() -> None:
        vars(invoke_subgraph).pop("gen_schema", None)
        memo.clear()

    return restore
