"""The marker ops' arguments, defined once.

[Note: The marker contract]
A parameter read traced by Dynamo becomes a ``compiled_fsdp::unshard`` marker
(its backward: ``reduce_grad``); a block's graph that hands the next block
its gather traces ``gather_next`` (its backward: ``reduce_next``). Their
arguments are the contract between the runtime, which emits them, and the
passes, which lower them. Each op's arguments are one frozen dataclass
below, and everything else is derived from it: the op's schema string
(``schema()``), the call (``call(**fields)``: by name, so an unknown or
missing name fails at once), the custom op's implementations
(``bind(args, kwargs)``, defaults filled) and the passes' parse of a graph
node (``parse(node)``, static arguments checked). Adding an argument is one
line here.

An op's arguments are its dataclass's fields, the tensors without a default
first and those with a default last (``names()``): the two markers of one parameter share most of theirs, declared
once in ``_ParamMarker``, and a subclass's own fields follow them.

``module_key`` names the fully sharded module (the n-th ``fully_shard`` call),
``ENTRY_KEY`` the module a frame was compiled for and ``NEXT_KEY`` the module
whose gather that frame hands over (DESIGN.md, "Blocks compiled on their
own"); the passes compare keys for equality only. ``reduce_by_all_to_all``
says how the gradient is reduced on its group (the choice is made once per
group by the runtime: [Note: Reduce-scatter on gloo] in core/comm.py).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar, Optional, TypeVar

import torch

from compiled_fsdp.core import rules
from compiled_fsdp.core.layout import ShardSpec

__all__ = ["ENTRY_KEY", "NEXT_KEY", "GatherNext", "Marker", "ReduceGrad", "ReduceNext", "Unshard", "sizes_dynamic"]

# The ``module_key`` of a module compiled as its own frame (group keys count up from 0).
ENTRY_KEY = -1
# The ``module_key`` of the block whose gather a block's graph hands over.
NEXT_KEY = -2

NAMESPACE = "compiled_fsdp"

M = TypeVar("M", bound="Marker")
_NO_DEFAULT = dataclasses.MISSING


def _arg(schema_type: str, default: Any = _NO_DEFAULT) -> Any:
    """A dataclass field with its type in the op's schema."""
    if default is _NO_DEFAULT:
        return dataclasses.field(metadata={"schema": schema_type})
    return dataclasses.field(default=default, metadata={"schema": schema_type})


def _schema_default(value: Any) -> str:
    if value is None or isinstance(value, bool):
        return str(value)
    assert isinstance(value, (int, float)), value
    return str(value)


# [Note: Static ints under dynamic=True]
# ``torch.compile(model, dynamic=True)`` makes Dynamo trace every int read
# off a Python object (not a module's, not a global's) as a symbolic graph
# input: a marker's full shape, world size, group key and the like, read
# off the parameter and its group, reached the passes symbolic, and every
# module's markers were left to their eager per-parameter collectives
# (38 unbucketed all-gathers a step in the test's model), while explain()
# said "compiled". ``Marker.call`` makes each of the op's ``STATIC_INTS``
# a plain int: Dynamo specializes a symbolic int passed to ``range`` (with a
# guard on its value; these never change between steps), and an int that
# was plain stays as it is. Only then: otherwise Dynamo would trace the
# loop over every static int of every marker in every compile. Tested by
# tests/test_dynamic_shapes.py::test_dynamic_true_buckets_every_collective.
def _static(value: int) -> int:
    return value if value < 0 else len(range(value))  # (ENTRY_KEY and NEXT_KEY are negative constants)


@torch._dynamo.assume_constant_result
def sizes_dynamic() -> bool:
    """Whether Dynamo traces with every size dynamic (``torch.compile(dynamic=True)``;
    at trace time, a constant to the traced code)."""
    return not torch._dynamo.config.assume_static_by_default


@dataclasses.dataclass(frozen=True)
class Marker:
    """One op's arguments (subclasses below). Tensor arguments hold tensors at
    run time and ``fx.Node``s when parsed from a graph."""

    NAME: ClassVar[str] = ""
    RETURNS: ClassVar[str] = "Tensor"
    # Argument names whose values must be plain ints for the passes.
    STATIC_INTS: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def qualname(cls) -> str:
        return f"{NAMESPACE}::{cls.NAME}"

    @classmethod
    def _fields(cls) -> list[dataclasses.Field]:
        """The op's arguments in schema order: the tensors without a default,
        the other arguments without one, then those with one; each part in
        declaration order (base class first)."""
        def rank(f: dataclasses.Field) -> int:
            if f.default is not _NO_DEFAULT:
                return 2
            return 0 if f.metadata["schema"].startswith("Tensor") else 1
        return sorted(dataclasses.fields(cls), key=rank)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in cls._fields())

    @classmethod
    def schema(cls) -> str:
        parts = []
        for f in cls._fields():
            text = f"{f.metadata['schema']} {f.name}"
            if f.default is not _NO_DEFAULT:
                text += f"={_schema_default(f.default)}"
            parts.append(text)
        return f"({', '.join(parts)}) -> {cls.RETURNS}"

    @classmethod
    def op(cls) -> Any:
        return getattr(getattr(torch.ops, NAMESPACE), cls.NAME)

    @classmethod
    def call(cls, **fields: Any) -> Any:
        """Runs the op (traced into a graph under Dynamo)."""
        for name in cls.STATIC_INTS if torch.compiler.is_dynamo_compiling() and sizes_dynamic() else ():
            value = fields.get(name)  # ([Note: Static ints under dynamic=True])
            if isinstance(value, (list, tuple)):
                fields[name] = [_static(v) for v in value]
            elif value is not None:
                fields[name] = _static(value)
        return cls.op()(**fields)

    @classmethod
    def bind(cls: type[M], args: Sequence[Any], kwargs: dict[str, Any]) -> M:
        """The arguments of a call (positional, then by name), defaults filled."""
        return cls(**dict(zip(cls.names(), args)), **kwargs)

    @classmethod
    def parse(cls: type[M], node: Any) -> M:
        """The arguments of a graph node calling this op, integer lists as
        tuples. Raises ValueError when an argument the passes need statically
        is symbolic."""
        bound = cls.bind(node.args, dict(node.kwargs))
        for name in cls.STATIC_INTS:
            value = getattr(bound, name)
            values = value if isinstance(value, (list, tuple)) else [value]
            if not all(isinstance(v, int) for v in values):
                raise ValueError(f"symbolic {name} {value!r}")
        ints = {f.name: tuple(getattr(bound, f.name)) for f in dataclasses.fields(cls)
                if f.metadata["schema"] in ("int[]", "SymInt[]")}
        return dataclasses.replace(bound, **ints)

    def static_values(self) -> tuple:
        """The arguments other than tensors (what two reads of one parameter share)."""
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self)
                     if not f.metadata["schema"].startswith("Tensor"))

    def values(self) -> dict[str, Any]:
        """The arguments by name (no copies, unlike ``dataclasses.asdict``)."""
        return {name: getattr(self, name) for name in self.names()}


class _OneParameter:
    """What the passes read off a marker of one parameter (``unshard``, ``reduce_grad``)."""

    full_shape: Sequence[int]
    world_size: int
    group_name: str
    reshard_after_forward: Optional[bool]
    outermost: bool
    reduce_by_all_to_all: bool

    replicate_group_name: Optional[str]
    replicas: int
    divide_factor: Optional[float]
    device: Optional[str]

    @property
    def spec(self) -> ShardSpec:
        """The parameter's layout and gradient divisor; see [Note: Shard layout]
        in core/layout.py."""
        return ShardSpec(tuple(self.full_shape), self.world_size, self.divide_factor, self.replicas)

    @property
    def reshards(self) -> bool:
        """Whether the whole application reshards after forward: see [Note:
        The reshard rule] in core/rules.py (the passes apply it per unit)."""
        return rules.reshards_after_forward(bool(self.reshard_after_forward), self.outermost)

    def bucket_signature(self) -> tuple:
        """What every marker of one bucket shares: its groups and how it reduces."""
        return (self.group_name, self.world_size, self.reduce_by_all_to_all, self.replicate_group_name,
                self.replicas, self.divide_factor, self.device)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _ParamMarker(Marker):
    """The arguments a parameter's read (``unshard``) and its backward
    (``reduce_grad``) share."""

    full_shape: Sequence[int] = _arg("SymInt[]")
    group_name: str = _arg("str")
    world_size: int = _arg("int")
    module_key: int = _arg("int")
    param_index: int = _arg("int")
    # How many rows of the parameter this rank holds (the shard's dim 0): see
    # [Note: Local rows in the marker] in core/ops.py.
    local_rows: int = _arg("int")
    # Mixed precision: the reduce dtype.
    reduce_dtype: Optional[torch.dtype] = _arg("ScalarType?", None)
    # See [Note: Accumulation without sync in graphs] in core/ops.py.
    kept: Any = _arg("Tensor?", None)
    sync: bool = _arg("bool", True)
    # Where this parameter lies in a bucket handed over by the graph before
    # (``bucket_numel`` 0: not handed over).
    bucket_offset: int = _arg("int", 0)
    bucket_numel: int = _arg("int", 0)
    reduce_by_all_to_all: bool = _arg("bool", False)
    # HSDP ([Note: HSDP] in runtime/api.py): the group the reduced shard is
    # all-reduced on (None: no replicas) and its size; and FSDP2's divide factor.
    replicate_group_name: Optional[str] = _arg("str?", None)
    replicas: int = _arg("int", 1)
    divide_factor: Optional[float] = _arg("float?", None)
    # CPU offload ([Note: CPU offload] in runtime/policy.py): for ``unshard``,
    # the compute device the shard is copied to before its gather; for
    # ``reduce_grad``, the device the reduced rows go back to (the shard's).
    # None: no copy.
    device: Optional[str] = _arg("str?", None)


# The static ints of every parameter marker.
_PARAM_INTS = ("full_shape", "world_size", "module_key", "param_index", "local_rows", "bucket_offset", "bucket_numel",
               "replicas")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Unshard(_ParamMarker, _OneParameter):
    """One parameter read: the local shard in, the full parameter out."""

    NAME: ClassVar[str] = "unshard"
    STATIC_INTS: ClassVar[tuple[str, ...]] = _PARAM_INTS + ("post_forward_size", "post_forward_rank")

    shard: Any = _arg("Tensor")
    # The user's policy; the passes apply the reshard rule (core/rules.py) per unit.
    reshard_after_forward: bool = _arg("bool")
    # The group the gradient is reduced on (None: ``group_name``).
    reduce_group_name: Optional[str] = _arg("str?", None)
    # Mixed precision: the gathered dtype.
    param_dtype: Optional[torch.dtype] = _arg("ScalarType?", None)
    # No fully sharded module contains this parameter's (the root's).
    outermost: bool = _arg("bool", False)
    # The gather handed over by the graph before (``bucket_offset`` and
    # ``bucket_numel`` place this parameter in it).
    gathered: Any = _arg("Tensor?", None)
    # An int reshard_after_forward: the group kept after forward, its size and
    # this rank's rank in it ([Note: Resharding to a smaller group] in
    # runtime/groups.py); None, 0, 0 otherwise.
    post_forward_group_name: Optional[str] = _arg("str?", None)
    post_forward_size: int = _arg("int", 0)
    post_forward_rank: int = _arg("int", 0)
    # Gathered through ``regather``, which takes a gather issued ahead for the
    # same shards ([Note: Gathers issued ahead of compile regions] in
    # compile/regions.py).
    take_ahead: bool = _arg("bool", False)
    # A float8 cast of the read is taken from the shard in its own dtype, not
    # in ``param_dtype``, as FSDP2's all-gather extension casts it ([Note:
    # Float8 weights cast before their gather in graphs] in passes/cast_gather.py).
    cast_from_shard: bool = _arg("bool", False)

    @property
    def post_forward(self) -> Optional[tuple[str, int, int]]:
        """(group, size, rank) of an int reshard_after_forward, or None."""
        if self.post_forward_group_name is None:
            return None
        return (self.post_forward_group_name, self.post_forward_size, self.post_forward_rank)

    @property
    def reduce_group(self) -> str:
        return self.reduce_group_name or self.group_name

    @property
    def grad_dtype(self) -> None:
        return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReduceGrad(_ParamMarker, _OneParameter):
    """The backward of one read: the full gradient in, this rank's averaged
    rows out (or, without sync, the full gradient for the sink; or, for a
    handed-over read, the gradient packed in the gather's layout)."""

    NAME: ClassVar[str] = "reduce_grad"
    STATIC_INTS: ClassVar[tuple[str, ...]] = _PARAM_INTS

    grad: Any = _arg("Tensor")
    # The dtype of the reduced shard gradient (the parameter's).
    grad_dtype: Optional[torch.dtype] = _arg("ScalarType?", None)

    # A reduce marker carries no gather policy.
    reshard_after_forward: ClassVar[None] = None
    outermost: ClassVar[bool] = False
    param_dtype: ClassVar[None] = None
    reduce_group_name: ClassVar[None] = None
    post_forward: ClassVar[None] = None

    @classmethod
    def of_read(cls, read: Unshard, grad: Any, grad_dtype: torch.dtype, handed: bool,
                shard_device: Optional[str] = None) -> "ReduceGrad":
        """The backward of ``read`` (``handed``: it read a handed-over gather),
        reduced on its reduce group; under CPU offload the reduced rows go
        back to ``shard_device`` (without sync the full gradient stays: the
        sink is on the compute device)."""
        return cls(grad=grad, full_shape=list(read.full_shape), group_name=read.reduce_group,
                   world_size=read.world_size, module_key=read.module_key, param_index=read.param_index,
                   local_rows=read.local_rows, reduce_dtype=read.reduce_dtype, grad_dtype=grad_dtype,
                   kept=read.kept if read.sync else None, sync=read.sync,
                   bucket_offset=read.bucket_offset if handed else 0,
                   bucket_numel=read.bucket_numel if handed else 0,
                   reduce_by_all_to_all=read.reduce_by_all_to_all,
                   replicate_group_name=read.replicate_group_name, replicas=read.replicas,
                   divide_factor=read.divide_factor,
                   device=shard_device if read.device is not None and read.sync and not handed else None)


@dataclasses.dataclass(frozen=True)
class GatherNext(Marker):
    """One module's bucketed all-gather, not waited, issued by the graph (or
    the eager code) before it. ``full_shapes``: the parameters' full shapes
    concatenated (each has its shard's number of dimensions). With ``sync``,
    ``kept`` holds each parameter's kept gradient (or None); without,
    ``sinks`` are the gradient sinks of the parameters ``sink_params``.
    ``live``: a 0-d bool, false for a stand-in that communicates nothing
    ([Note: A stand-in for the last block's next] in core/gated.py). (No
    defaults: autograd counts only the arguments a call passes.)"""

    NAME: ClassVar[str] = "gather_next"
    STATIC_INTS: ClassVar[tuple[str, ...]] = ("full_shapes", "local_rows", "world_size", "module_key", "replicas")

    shards: Any = _arg("Tensor[]")
    kept: Any = _arg("Tensor?[]")
    sinks: Any = _arg("Tensor[]")
    sink_params: Sequence[int] = _arg("int[]")
    full_shapes: Sequence[int] = _arg("int[]")
    local_rows: Sequence[int] = _arg("int[]")
    group_name: str = _arg("str")
    world_size: int = _arg("int")
    module_key: int = _arg("int")
    reduce_group_name: Optional[str] = _arg("str?")
    param_dtype: Optional[torch.dtype] = _arg("ScalarType?")
    reduce_dtype: Optional[torch.dtype] = _arg("ScalarType?")
    sync: bool = _arg("bool")
    reduce_by_all_to_all: bool = _arg("bool")
    # FSDP2's set_gradient_divide_factor (None: the mean over world_size).
    divide_factor: Optional[float] = _arg("float?")
    # HSDP: the replicas' group (None: none) and how many there are.
    replicate_group_name: Optional[str] = _arg("str?")
    replicas: int = _arg("int")
    live: Any = _arg("Tensor")

    @property
    def reduce_group(self) -> str:
        return self.reduce_group_name or self.group_name


@dataclasses.dataclass(frozen=True)
class ReduceNext(Marker):
    """The backward of ``gather_next``: the whole bucket's full gradient, in
    the gather's layout, in; each parameter's reduced rows (or, without sync,
    its full gradient) out."""

    NAME: ClassVar[str] = "reduce_next"
    RETURNS: ClassVar[str] = "Tensor[]"
    STATIC_INTS: ClassVar[tuple[str, ...]] = ("full_shapes", "ndims", "local_rows", "world_size", "module_key",
                                              "replicas")

    grad: Any = _arg("Tensor")
    kept: Any = _arg("Tensor?[]")
    full_shapes: Sequence[int] = _arg("int[]")
    ndims: Sequence[int] = _arg("int[]")
    local_rows: Sequence[int] = _arg("int[]")
    group_name: str = _arg("str")
    world_size: int = _arg("int")
    module_key: int = _arg("int")
    reduce_dtype: Optional[torch.dtype] = _arg("ScalarType?", None)
    grad_dtype: Optional[torch.dtype] = _arg("ScalarType?", None)
    sync: bool = _arg("bool", True)
    reduce_by_all_to_all: bool = _arg("bool", False)
    divide_factor: Optional[float] = _arg("float?", None)
    # HSDP: the reduced bucket is also summed over the replicas' group.
    replicate_group_name: Optional[str] = _arg("str?", None)
    replicas: int = _arg("int", 1)
    live: Any = _arg("Tensor?", None)  # (None: live) see GatherNext

    @classmethod
    def of_gather(cls, gather: GatherNext, grad: Any) -> "ReduceNext":
        shards = gather.shards
        return cls(grad=grad, kept=list(gather.kept) if gather.sync else [],
                   full_shapes=list(gather.full_shapes), ndims=[s.dim() for s in shards],
                   local_rows=list(gather.local_rows), group_name=gather.reduce_group,
                   world_size=gather.world_size, module_key=gather.module_key,
                   reduce_dtype=gather.reduce_dtype, grad_dtype=shards[0].dtype, sync=gather.sync,
                   reduce_by_all_to_all=gather.reduce_by_all_to_all, divide_factor=gather.divide_factor,
                   replicate_group_name=gather.replicate_group_name, replicas=gather.replicas,
                   live=gather.live)


@dataclasses.dataclass(frozen=True)
class Regather(Marker):
    """A handed-in module's backward re-gather, waited: the one prefetched
    for its shards if there is one, else gathered now. See [Note: Backward
    re-gathers prefetched across graphs] in core/registry.py."""

    NAME: ClassVar[str] = "regather"
    STATIC_INTS: ClassVar[tuple[str, ...]] = ("full_shapes", "world_size", "module_key")

    shards: Any = _arg("Tensor[]")
    full_shapes: Sequence[int] = _arg("int[]")
    group_name: str = _arg("str")
    world_size: int = _arg("int")
    module_key: int = _arg("int")
    param_dtype: Optional[torch.dtype] = _arg("ScalarType?", None)
    # A backward re-gather: it takes only gathers issued for a backward, and
    # then issues the one the registry chains after its own (a compile
    # region's: [Note: Gathers issued ahead of compile regions] in compile/regions.py).
    backward: bool = _arg("bool", False)
    # CPU offload: the compute device the shards are copied to before the
    # gather (None: no copy), as ``unshard``'s.
    device: Optional[str] = _arg("str?", None)


@dataclasses.dataclass(frozen=True, kw_only=True)
class IssueAhead(Regather):
    """The all-gather of a module expected to run soon, issued now and not
    waited, for its ``regather`` to take (only a bucket some ``regather``
    took before). See [Note: Gathers issued ahead of compile regions] in
    compile/regions.py."""

    NAME: ClassVar[str] = "issue_ahead"

    # What it must follow (every tensor the region before it takes, so the
    # previous region's output): the ranks' order.
    after: Any = _arg("Tensor[]")


@dataclasses.dataclass(frozen=True)
class ReduceLater(Marker):
    """A compile region's gradient bucket, reduced after the region's graph
    returns: each parameter's full gradient (in the reduce dtype) in, and
    what ``kept`` holds for it from micro-batches without sync (None:
    nothing); this rank's averaged rows added later to the gradient of the
    parameter whose shard ``targets`` holds. Returns an empty tensor. See
    [Note: A region's reduce-scatter waited outside its graph] in
    core/registry.py."""

    NAME: ClassVar[str] = "reduce_later"
    STATIC_INTS: ClassVar[tuple[str, ...]] = ("full_shapes", "ndims", "local_rows", "world_size", "replicas")

    grads: Any = _arg("Tensor[]")
    kept: Any = _arg("Tensor?[]")
    targets: Any = _arg("Tensor[]")
    full_shapes: Sequence[int] = _arg("int[]")
    ndims: Sequence[int] = _arg("int[]")
    local_rows: Sequence[int] = _arg("int[]")
    group_name: str = _arg("str")
    world_size: int = _arg("int")
    reduce_by_all_to_all: bool = _arg("bool", False)
    divide_factor: Optional[float] = _arg("float?", None)
    # HSDP: the replicas' group the reduced rows are then all-reduced on
    # (None: none), and how many replicas there are.
    replicate_group_name: Optional[str] = _arg("str?", None)
    replicas: int = _arg("int", 1)


MARKERS: tuple[type[Marker], ...] = (Unshard, ReduceGrad, GatherNext, ReduceNext, Regather, IssueAhead, ReduceLater)
