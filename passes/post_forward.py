"""An int ``reshard_after_forward`` in graphs: the backward gathers over the smaller group.

[Note: Resharding to a smaller group in graphs]
An int ``reshard_after_forward`` ([Note: Resharding to a smaller group] in
compiled_fsdp/runtime/groups.py) in a joint graph: the lowering follows
the forward's gather with this rank's part of it (``layout.post_forward_part``
as one op, ``copy_out.keep_part``, registered as having a side effect so
that the partitioner saves it rather than recompute it and the forward's
whole gather in backward; tagged ``post_forward_part``, which
passes/recompute.py marks ``MUST_SAVE``)
and with an all-gather of the parts over the post-forward group, unpacked as
the forward's gather is (``gather_again``, tagged ``post_forward_chain``).
``backward_reads`` points the backward's reads at that second chain, and the
recompute pass tags it to be recomputed in backward and *only* there
(the partitioner's ``must_be_in_backward``: without it the forward graph
would run the second gather too, unread, since the partitioner never drops
a wait); the forward's own chain is then read by forward alone. The schedule
places the second chain as any backward gather (its own chain tag). Tested
by tests/test_reshard_int.py (the group sizes of each graph's gathers, and
what the forward saves).

Under the user's activation checkpointing the recomputed forward reads the
forward's own gather again in backward (one joint node cannot read one
gather in forward and another when recomputed), so the second chain would
only add a gather and keep a part: a bucket read in a checkpointed region
(``read_under_checkpoint``) is resharded over the whole group, as ``True``
would (tests/test_reshard_int.py, ``aot_eager``).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch.fx as fx

from compiled_fsdp.core.layout import ShardSpec

from ._emit import emit_unpack
from .cost_model import WAIT, all_gather_op
from .graph import NodeBuilder, tangent_dependents

__all__ = ["backward_reads", "gather_again", "read_under_checkpoint"]


def gather_again(b: NodeBuilder, part: fx.Node, size: int, group_name: str,
                 specs: Sequence[ShardSpec]) -> list[fx.Node]:
    """The all-gather of the kept parts over the post-forward group, waited and
    unpacked: each parameter again, for backward."""
    gather = all_gather_op(group_name, b.value(part).device)
    return emit_unpack(b, b(WAIT, b(gather, part, size, group_name)), specs)


def backward_reads(graph: fx.Graph, fulls: list[fx.Node], again: list[fx.Node], meta: dict[str, Any]) -> None:
    """The backward's reads of the gathered parameters ``fulls`` (and of what
    forward derives from them alone: a transpose, a cast) go to ``again``.
    Such derived nodes get a twin fed by ``again``, with ``meta`` (its chain's tag)."""
    backward = tangent_dependents(graph)
    twin = dict(zip(fulls, again))
    for n in list(graph.nodes):
        if n.op != "call_function" or n in backward or n in twin or not n.all_input_nodes \
                or not all(i in twin for i in n.all_input_nodes):
            continue
        with graph.inserting_after(n):
            copy = graph.node_copy(n, lambda a: twin.get(a, a))
        copy.meta.update(meta)
        twin[n] = copy
    for orig, copy in twin.items():
        for user in list(orig.users):
            if user in backward:
                user.replace_input_with(orig, copy)
    for orig, copy in reversed(list(twin.items())):
        if orig not in fulls and not copy.users:
            graph.erase_node(copy)


def read_under_checkpoint(reads: list[fx.Node]) -> bool:
    """Whether a node of the user's activation checkpointing (a recompute
    policy set before our passes ran) reads a parameter read by ``reads``
    (the bucket's markers), or a node derived from them alone."""
    seen, todo = set(reads), list(reads)
    while todo:
        for user in todo.pop().users:
            if user in seen:
                continue
            if user.meta.get("recompute") is not None:
                return True
            seen.add(user)
            if all(i in seen for i in user.all_input_nodes):
                todo.append(user)
    return False

