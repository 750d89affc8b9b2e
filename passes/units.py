"""Units: which of an application's parameters are gathered and reduced together.

[Note: Units]
``fully_shard(module)`` makes one *application*: the parameters it owns. The
eager runtime communicates an application as one bucket. The lowering instead
cuts each application of a graph into *units* chosen from the graph, so that a
single ``fully_shard(model)`` gathers and reduces layer by layer:

1. Each parameter is placed where it is first read: the ``nn_module_stack`` of
   its first marker (graph order), a path of module calls from the compiled
   frame. Stack entries are compared by their keys only (never by parsing a
   name); the names appear in reports. The application's node is the longest
   path all its parameters share.
2. An application no other fully sharded module contains (the root: a single
   call, or the root's leftovers when the user nested) starts as one piece per
   module its node calls, in first-use order, plus one piece for the
   parameters the node reads itself (``GPT.pos``). An application the user
   nested inside another starts whole: their nesting is their choice of units,
   but for the step's opening block, which is cut as the root is ([Note: The
   step's opening block cut by first use]).
3. A piece larger than the ceiling splits the same way at the modules its node
   calls, recursively (a piece read by one module only cannot split). The
   ceiling is ``config.overlap.unit_max_bytes`` (None: none), and for the root also
   half the application's bytes: with about two units in flight (the
   scheduler's budget), a unit of more than half would hold as much as the
   unsharded model. That is what splits a container called as one module (an
   ``nn.Sequential`` of blocks) into its blocks.
4. Small pieces merge with their neighbours by the bucketing rule
   (``group_small`` in bucketing.py: below ``config.overlap.bucket_bytes`` and
   at most 1/8 of the largest piece of any application in the graph), so a norm or a positional embedding does
   not pay a collective's latency alone. Neighbours in the graph's use order:
   two pieces between whose first reads no other application's parameter is
   first read (the root's ``pos``, read first, and its final norm, read last,
   are not neighbours when the user nested the blocks in between).
5. Every unit reshards after forward as the user asked, except the root's unit
   whose last forward use comes last: backward needs it first, so re-gathering
   it would be a wasted gather. This is [Note: The reshard rule]
   (compiled_fsdp/core/rules.py), applied to the unit it is for.
   A tied embedding and head land in one unit (the embedding's), used first and
   last, so it stays gathered through forward as the root's bucket did before.
   In a graph that holds only part of the root's forward (a graph break in
   it), "last" is the last in that graph: kept until that graph's backward,
   as the whole root was before units.
6. The bucketing then merges small units across applications the same way
   ([Note: Bucket threshold]), among units of equal resharding.

Blocks sharded with ``fully_shard`` but no ``fully_shard`` on the root are each
outermost, so each is cut at the modules it calls; applying ``fully_shard`` to
the root as well (the usual form) keeps them whole, but for the first ([Note:
The step's opening block cut by first use]).

Reduce buckets use the same units (the gradient of a parameter is reduced with
its unit's). Everything above depends on graph structure and agreed sizes only,
so every rank decides the same. A graph without module stacks (hand-built
graphs) keeps one unit per application. Tested by tests/test_units_fx.py and
tests/test_units_dist.py.
"""

# [Note: The step's opening block cut by first use]
# A step's first gathers (the root's first unit, then the first block) and
# its last reduce-scatters (the first block's, then the root's) lie on one
# chain across the optimizer step, with nothing of the step to run beside
# them (DESIGN, "What no schedule hides"). Only a finer bucket shortens it.
# So in a graph that holds the root's reads, the nested application whose
# parameters are first read first after the root's (the first block) is
# cut at the modules it calls, as the root is (its norms merging with a
# neighbour by the bucketing rule): its attention's parameters gathered
# first, the feed-forward's behind the attention's compute, and in backward
# the feed-forward's reduced behind the attention's backward. Its parts
# merge with a neighbour below ``config.overlap.bucket_bytes`` whatever the
# graph's largest piece: a part worth less than a collective's latency gains
# nothing from the cut, and a small model's first block stays whole. It is
# what a user gets by sharding the first block's feed-forward on its own, chosen
# from the graph: the emulated benchmark's ``--split-first-block`` measured
# that at W=8 on the CPU, 67-69 -> 52-60 ms exposed a step (RESULTS,
# fifty-sixth session). Every other block stays whole: its gather runs
# behind the block before it, and a cut would cost one more collective a
# block. ``config.overlap.split_opening`` (default True) turns it off. (With
# compile regions the first block is not cut unless every block is: the
# note below.)
# Tested by tests/test_units_fx.py::test_the_opening_block_is_cut_by_first_use
# and ::test_only_the_opening_block_is_cut_in_the_lowering; on two ranks,
# bitwise, by tests/test_compile_parity.py::test_the_opening_block_cut_on_ranks.

# [Note: Every compile region cut as the opening block]
# With compile regions (the default) the first block is a region whose one
# graph every block runs, so a cut of the opening block would be every
# block's. With ``config.overlap.split_regions`` (off by default: below) a
# region's graph (its reads taken from gathers issued ahead, one nested
# application) is cut as the opening block is, its parts merging below
# ``bucket_bytes`` alike. Each block then gathers and reduces its parts apart,
# a collective more each way a block; the outer graph still issues each
# region's whole bucket ahead, and the run time issues it in the parts the
# region's graph took ([Note: A bucket issued in the parts its graph takes] in
# compiled_fsdp/core/registry.py). Measured at W=8 on the CPU's matched link,
# two rounds each way (RESULTS, fifty-eighth session): 12-13 ms a step less
# exposed (69 -> 56-57 ms; the step's first gathers 35 -> 25.6 ms, its last
# reduce-scatters 34.7 -> 22.7), and 21-26 ms more host work (88 more host
# calls a step), the step 1-2% slower. So ``config.overlap.split_regions``
# is off by default; on a GPU, whose host runs ahead of its kernels, it should
# pay, and benchmarks/gpu_session.sh measures it (``--split-regions``).
# Tested by tests/test_block_regions.py::test_regions_cut_take_their_parts_issued_ahead.

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Optional

import torch.fx as fx

from compiled_fsdp.core import rules

from .bucketing import group_small

# A path of module calls: ((stack key, display name), ...), outermost first.
Path = tuple[tuple[str, str], ...]


@dataclasses.dataclass(frozen=True)
class Unit:
    """One unit of one application (what a gather bucket carries before the
    bucketing may merge it with another application's)."""

    module_key: int
    index: int  # in forward use order within the application
    param_indices: tuple[int, ...]
    modules: tuple[str, ...]  # the module calls whose reads it holds (display)
    nbytes: int  # unsharded, in the gathered dtype
    reshard_after_forward: bool
    reason: str

    def describe(self) -> str:
        """One line for ``explain()`` and the dump's index."""
        kept = "" if self.reshard_after_forward else ", kept from forward to backward"
        return (f"unit {self.index}: {', '.join(self.modules) or '-'}, "
                f"{self.nbytes / 1024:.1f} KiB unsharded{kept} ({self.reason})")


@dataclasses.dataclass(frozen=True)
class SlotUse:
    """What the unit choice needs of one parameter of an application."""

    param_index: int
    path: Path  # where it is first read
    first: int  # graph position of its first read
    last: int  # graph position of its last read
    nbytes: int


@dataclasses.dataclass
class _Piece:
    path: Path
    slots: list[SlotUse]
    reason: str
    own: bool = False  # the parameters ``path``'s module reads itself

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.slots)

    @property
    def first(self) -> int:
        return min(s.first for s in self.slots)


def module_path(node: fx.Node) -> Path:
    """The module calls ``node`` was traced in, outermost first, each named
    by its path from the compiled module, as a user names it."""
    stack = node.meta.get("nn_module_stack") or {}
    return tuple((str(k), _display(v)) for k, v in stack.items())


# Dynamo's name of a frame's local: ``L['self']``, or ``L['args'][0]`` where a
# decorator's wrapper ``f(*args, **kwargs)`` is the frame (transformers' on
# Llama's ``forward``); an index after any other local is the module's own.
_LOCAL = re.compile(r"^L\['(?:args|kwargs)'\]\[[^\]]*\]|^L\['[^']*'\]")


def _display(entry: object) -> str:
    name = str(entry[0] if isinstance(entry, tuple) and entry else entry)
    local = _LOCAL.match(name)
    if local is None:
        return name
    return name[local.end():].removeprefix(".") or "<compiled module>"


def _common(paths: Sequence[Path]) -> Path:
    out: list[tuple[str, str]] = []
    for level in zip(*paths):
        if any(p[0] != level[0][0] for p in level):
            break
        out.append(level[0])
    return tuple(out)


def _children(piece: _Piece) -> list[_Piece]:
    """The piece cut at the modules its node calls (first-use order); the
    node's own reads form one more piece."""
    depth = len(piece.path)
    by_key: dict[str, list[SlotUse]] = {}
    for s in sorted(piece.slots, key=lambda s: s.first):
        key = s.path[depth][0] if len(s.path) > depth else ""
        by_key.setdefault(key, []).append(s)
    # (by_key's order is first-use order: the slots were walked in it.)
    return [_Piece(piece.path if key == "" else piece.path + (slots[0].path[depth],), slots, "",
                   own=key == "")
            for key, slots in by_key.items()]


def _name(path: Path, own: bool = False) -> str:
    name = path[-1][1] if path else "<compiled module>"
    return f"{name} (own reads)" if own else name


def _split(piece: _Piece, ceiling: Optional[float]) -> list[_Piece]:
    if ceiling is None or piece.nbytes <= ceiling:
        return [piece]
    kids = _children(piece)
    if len(kids) == 1 and not kids[0].own:  # a wrapper: look through it
        kids[0].reason = piece.reason
        return _split(kids[0], ceiling)
    if len(kids) < 2:
        piece.reason += f"; above the ceiling ({int(ceiling)} B) but read by one module"
        return [piece]
    out = []
    for kid in kids:
        kid.reason = (f"{_name(kid.path, kid.own)}: split from {_name(piece.path)} "
                      f"({piece.nbytes} B > ceiling {int(ceiling)} B)")
        out.extend([kid] if kid.own else _split(kid, ceiling))
    return out


def choose_units(
    module_key: int, uses: Sequence[SlotUse], outermost: bool, reshard: bool,
    bucket_bytes: int, max_bytes: Optional[int], others: Sequence[int] = (),
    largest: Optional[int] = None, opening: bool = False,
) -> list[Unit]:
    """The units of one application, in forward use order. ``others``: the
    graph positions where other applications' parameters are first read;
    ``largest``: the largest piece of the graph's applications (default: of
    this one); ``opening``: a nested application cut at the modules it calls
    all the same ([Note: The step's opening block cut by first use]).
    ``bucket_bytes=0`` merges nothing. See [Note: Units]."""
    ordered = sorted(uses, key=lambda s: s.first)
    whole = _Piece(_common([s.path for s in ordered]), ordered, "")
    cut = opening and not outermost  # ([Note: The step's opening block cut by first use])
    if not any(s.path for s in ordered):
        whole.reason = "one unit: the graph records no module calls"
        pieces = [whole]
    elif cut:
        pieces = []
        for kid in _children(whole):
            kid.reason = (f"{_name(kid.path, kid.own)}: the step's opening block cut by first use "
                          "(config.overlap.split_opening; in a compile region, split_regions)")
            pieces.extend([kid] if kid.own else _split(kid, max_bytes))
    elif not outermost:
        whole.reason = "one unit: the user's fully_shard nesting"
        pieces = _split(whole, max_bytes)
    else:
        ceiling = whole.nbytes / 2 if max_bytes is None else min(max_bytes, whole.nbytes / 2)
        pieces = []
        for kid in _children(whole):
            kid.reason = (f"{_name(kid.path, True)}: the root's own reads" if kid.own
                          else f"{_name(kid.path)}: a module the root calls")
            pieces.extend([kid] if kid.own else _split(kid, ceiling))
    def adjacent(group: list[_Piece], nxt: _Piece) -> bool:
        return not any(group[-1].first < at < nxt.first for at in others)

    # (the opening block's parts merge below the threshold alone, whatever the largest piece)
    groups = group_small(pieces, lambda p: p.nbytes, bucket_bytes, adjacent,
                         8 * max(bucket_bytes, whole.nbytes) if cut else largest)
    if cut and len(groups) == 1:  # (merged back whole: said as the user's nesting)
        whole.reason = "one unit: the user's fully_shard nesting"
        groups = [[whole]]
    last_use = [max(s.last for p in g for s in p.slots) for g in groups]
    units = []
    for i, g in enumerate(groups):
        used_last = last_use[i] == max(last_use)
        reshards = rules.reshards_after_forward(reshard, outermost, used_last)  # [Note: The reshard rule]
        reason = "; ".join(p.reason for p in g)
        if len(g) > 1:
            reason = f"small neighbours merged (< {bucket_bytes} B): {reason}"
        if reshard and not reshards and len(groups) > 1:
            reason += "; not resharded: used last in forward, first in backward"
        units.append(Unit(
            module_key=module_key, index=i,
            param_indices=tuple(sorted(s.param_index for p in g for s in p.slots)),
            modules=tuple(_name(p.path, p.own) for p in g), nbytes=sum(p.nbytes for p in g),
            reshard_after_forward=reshards, reason=reason,
        ))
    return units


def slot_uses(markers_by_param: dict[int, list[fx.Node]], nbytes: Callable[[int], int],
              order: dict[fx.Node, int]) -> list[SlotUse]:
    """One ``SlotUse`` per parameter from its markers (any order)."""
    out = []
    for index, markers in markers_by_param.items():
        ms = sorted(markers, key=order.__getitem__)
        out.append(SlotUse(index, module_path(ms[0]), order[ms[0]], order[ms[-1]], nbytes(index)))
    return out
