"""One schema per compile region in a trace.

[Note: One schema per region]
Under autograd, torch runs a higher-order op's ``gen_schema`` at every call
of it (``HigherOrderOperator``'s autograd kernel, in every release
2.11-2.15), only to refuse a subgraph that writes its inputs. For
``invoke_subgraph`` that means tracing the region's body again with
``make_fx`` and walking the result for mutations and aliases: twice for
every block that calls a region while AOTAutograd traces the outer graph
(its metadata pass and its joint trace; on 2.11 functionalization asks
again at every call, uncached). That is torch's cost for its own regions
as much as for ours, and at 32 GPT blocks it was about an eighth of a cold
first step on the CPU (RESULTS, "One schema per region").

torch makes the schema by tracing the body again from fresh tensors of the
operands' type, shape, stride, dtype, device and ``requires_grad``, and it
records only each argument's kind and which operands the body writes. So
the same graph object, under the same identifier, called on operands equal
in all of those, has the same schema. ``memoize_region_schemas`` keeps each
answer for the rest of the compile window ([Note: Passes installed while
compiling] in install.py) and gives it again for such a call: about three
a region (the autograd key's, and functionalization's of its forward and
backward graphs). It takes it that no pass edits a region's graph in place
while the window is open (torch's and ours make new graphs). A region's
first call still runs torch's check, so a region that writes its inputs
is refused as before. The memo holds the graphs it keys on; it goes, and
torch's own method is back, when the window closes. A subgraph that is not a ``GraphModule`` (a Python function)
and operands with no strides are passed through. Tested:
tests/test_block_regions.py::test_identical_blocks_compile_once.
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
    memo: dict[tuple, Any] = {}  # (keyed on the graph itself: a module hashes by identity)

    def gen_schema(subgraph: Any, identifier: Any, *operands: Any) -> Any:
        if not isinstance(subgraph, fx.GraphModule) or any(
                isinstance(o, torch.Tensor) and o.layout != torch.strided for o in operands):
            return original(subgraph, identifier, *operands)
        key = (subgraph, identifier, tuple(map(_operand_key, operands)))
        if key not in memo:
            memo[key] = original(subgraph, identifier, *operands)
        return memo[key]

    invoke_subgraph.gen_schema = gen_schema

    def restore() -> None:
        if vars(invoke_subgraph).get("gen_schema") is gen_schema:
            del invoke_subgraph.gen_schema
        memo.clear()

    return restore
