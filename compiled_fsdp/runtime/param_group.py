"""The parameter group: all managed parameters of one fully sharded module, the
unit of communication (one all-gather, one reduce-scatter; ``replicate``'s
may reduce in several buckets). Its eager autograd function: unshard_fn.py.
See [Note: Resharding to a smaller group] in groups.py for the state
``SHARDED_POST_FORWARD``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
from typing import TYPE_CHECKING, Any, Optional, Protocol, Sequence

import torch
import torch.distributed as dist

from compiled_fsdp.core import registry, rules
from compiled_fsdp.core.comm import PendingCollective
from compiled_fsdp.core.layout import EAGER, bucket_offsets, bucket_width, post_forward_part
from compiled_fsdp.runtime.collectives import all_gather_bucket, all_gather_part, copy_out_all_gather, reduce_bucket
from compiled_fsdp.runtime.divergence import COLLECTIVE, Checker, Checkpoint, PendingCheck, stable_code
from compiled_fsdp.runtime.ext_gather import ExtensionGather
from compiled_fsdp.runtime.param import FSDPParam
from compiled_fsdp.runtime.reduces import GroupReduces, PendingReduce, byte_buckets
from compiled_fsdp.runtime.unshard_fn import UnshardFn, static_view

if TYPE_CHECKING:
    from compiled_fsdp.runtime.streams import CommStreams


class Phase(enum.Enum):
    """Where a root's iteration is (see [Note: Roots and iterations] in context.py)."""

    IDLE = "idle"  # between forwards (or in backward)
    FORWARD = "forward"  # the root's forward runs eagerly, now
    COMPILED_FORWARD = "compiled forward"  # the root's forward runs under Dynamo, now


class ShardedState(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"  # all-gather issued, not awaited (a prefetch)
    UNSHARDED = "unsharded"
    # after forward, with an int reshard_after_forward: [Note: Resharding to a smaller group] in groups.py
    SHARDED_POST_FORWARD = "sharded post forward"



class GroupContext(Protocol):
    """What a group asks of its root's iteration (``state.RootContext``, set
    at lazy init), named here so that this module never imports the state's."""

    phase: Phase
    streams: Optional["CommStreams"]

    def on_reduce_issued(self, group: "FSDPParamGroup") -> None:
        """``group`` issued a reduction: the root awaits the others' (at most
        two groups' in flight) and queues the end of backward."""

class FSDPParamGroup:
    """One ``fully_shard`` application's parameters, communicated together."""

    def __init__(
        self,
        fsdp_params: list[FSDPParam],
        process_group: dist.ProcessGroup,
        reduce_group: dist.ProcessGroup,
        key: int,
        reshard_after_forward: bool,
        name: str,
        checker: Optional[Checker] = None,
        *,
        reduce_by_all_to_all: bool,
        hand_over_gathers: bool,
        replicate_group: Optional[dist.ProcessGroup] = None,
        block_regions: bool = False,
        post_forward_group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        self.fsdp_params = fsdp_params
        self.process_group = process_group
        self.group_name = process_group.group_name
        # See [Note: A second group for reduce-scatters] in groups.py.
        self.reduce_group = reduce_group
        self.reduce_group_name = reduce_group.group_name
        # HSDP: the replicas' group, over which each reduced shard is also
        # summed ([Note: HSDP] in api.py); None: a 1-D mesh.
        self.replicate_group = replicate_group
        self.replicate_group_name = replicate_group.group_name if replicate_group is not None else None
        # See [Note: Reduce-scatter on gloo] in core/comm.py (decided at fully_shard).
        self.reduce_by_all_to_all = reduce_by_all_to_all
        self.key = key
        self.name = name
        self.fqn = name  # the module's name under its root, set at the root's lazy init
        self.reshard_after_forward = reshard_after_forward
        self._post_forward_part: Optional[torch.Tensor] = None
        # See [Note: Gradient accumulation without sync] in module.py.
        self.reduce_grads = True
        self.reshard_after_backward = True
        # FSDPModule.set_unshard_in_backward: False for a module whose
        # parameters backward does not read (FSDP2's meaning). Decided after
        # each eager forward while ``decides_unshard_in_backward`` (None: the
        # root's lazy init sets it: [Note: Embeddings are not gathered for
        # backward] in backward_use.py); the user's call sets it False.
        self.unshard_in_backward = True
        self.decides_unshard_in_backward: Optional[bool] = None
        # Gathered for its backward when the root's forward ended: kept past the
        # end of a backward that did not reach it ([Note: Prefetch order] in context.py).
        self.kept_for_backward = False
        # FSDPModule.set_reduce_scatter_unused_params: a parameter that got no
        # gradient reduces zeros (so every rank reduces the same buffers).
        self.reduce_unused = False
        # No fully sharded module contains this one (yet): see [Note: The reshard rule].
        self.outermost = True
        # Whether blocks compiled on their own may hand this module its gather
        # (config.comm.hand_over_gathers, agreed at fully_shard).
        self.hand_over_gathers = hand_over_gathers
        # Whether its module asked to be a compile region under a whole-model
        # compile (config.comm.block_regions, agreed at fully_shard); it becomes
        # one when a module above it is sharded: see [Note: Blocks as compile
        # regions] in compile/regions.py.
        self.block_regions = block_regions
        # Why its module is no region though it asked (None: it is one, or it
        # is not yet below a sharded module): set by the ``fully_shard`` of a
        # module above it, read by explain().
        self.region_refusal: Optional[str] = None
        self.specs = [p.spec for p in fsdp_params]
        # See [Note: All-gather extensions] in ext_gather.py (None: none here).
        self.extension_gather = ExtensionGather(fsdp_params) if any(
            p.extension is not None for p in fsdp_params) else None
        # Whether only the eager runtime gathers it, compiled or not ([Note:
        # Extension groups run the eager runtime] in compile/path.py): an
        # extension's (an offloaded group's only in a block compiled on its
        # own: ``copies_in_graph``).
        self.gathers_eagerly = self.extension_gather is not None
        # Whether a whole-model graph gathers it all the same: its extensions
        # are torchao's float8 weights, which the graph reads in high precision
        # and casts itself, before the gather ([Note: Float8 weights cast
        # before their gather in graphs] in passes/cast_gather.py).
        self.casts_in_graph = self.extension_gather is not None and not any(p.offload for p in fsdp_params) \
            and all(p.extension is None or p.extension.casts_in_graph for p in fsdp_params)
        # Whether its shards are offloaded ([Note: CPU offload] in policy.py)
        # and a whole-model graph copies each to the compute device before its
        # gather ([Note: CPU offload in graphs] in passes/lowering.py); a block
        # compiled on its own is gathered by the eager runtime.
        self.copies_in_graph = self.extension_gather is None and any(p.offload for p in fsdp_params)
        # Whether its module's code computes with DTensors ([Note: FSDP over
        # DTensor parameters] in param.py: tensor parallelism, dp_mesh_dims) or
        # spmd_types-typed tensors ([Note: spmd_types parameters]): such a
        # module is no compile region (its types cannot cross the region's
        # boundary: [Note: Blocks as compile regions] in compile/regions.py).
        self.computes_dtensors = any(p.dtensor_spec is not None or p.annotated is not None for p in fsdp_params)
        # Per parameter: where it lies in the group's gathered bucket ([Note: Bucket layout]).
        self.bucket_numel = bucket_width(self.specs)
        for i, (p, offset) in enumerate(zip(fsdp_params, bucket_offsets(self.specs))):
            p.group, p.index, p.bucket_offset = self, i, offset
        self.state = ShardedState.SHARDED
        self.set_post_forward_group(post_forward_group)
        # See [Note: Agreeing on collectives] in divergence.py.
        self.checker = checker
        self.check_number = checker.register() if checker is not None else -1
        registry.register_owner(self)
        self._pending_gather: Optional[PendingCollective] = None
        self._gather_check: Optional[PendingCheck] = None
        # The parameters' indices of each reduce bucket, in backward order
        # (one bucket, all of them, but for ``replicate``'s byte buckets:
        # ``set_reduce_buckets``), and which of them reduced this iteration.
        self.reduce_buckets: tuple[tuple[int, ...], ...] = (tuple(range(len(fsdp_params))),)
        self._bucket_of: tuple[int, ...] = (0,) * len(fsdp_params)  # parameter index -> its bucket
        # This iteration's buckets whose autograd function has a gradient to
        # wait for, and those whose backward ran.
        self._applied_buckets: set[int] = set()
        self._anchor: Optional[torch.Tensor] = None  # (see _grad_anchor)
        self._reduced_buckets: set[int] = set()
        self.reduces = GroupReduces()  # (issued, not yet awaited; offloaded gradients not yet landed)
        # Views handed to the module's code while it runs eagerly; see [Note: Parameter property] in module_class.py.
        self.exposed_views: Optional[Sequence[Optional[torch.Tensor]]] = None
        # Autograd outputs of this iteration's UnshardFn (None: its bucket's
        # not applied yet: ``view_of``), reused by later calls.
        self._iter_views: Optional[Sequence[Optional[torch.Tensor]]] = None
        self.needs_grad_sync = False  # a backward was registered for this iteration
        # The root's RootContext (see [Note: Roots and iterations]), set at lazy init.
        self.ctx: Optional[GroupContext] = None
        # The compile layer's state for this group (see [Note: The compiled path]).
        self.compiled: Any = None

    def set_post_forward_group(self, group: Optional[dist.ProcessGroup]) -> None:
        """An int reshard_after_forward's group, or None ([Note: Resharding to
        a smaller group]); ``post_forward_args``: its name, size and this
        rank's rank in it, as plain values (the markers read them while
        Dynamo traces, which must not call into a process group)."""
        if self.state is ShardedState.SHARDED_POST_FORWARD:
            self.reshard()
        self.post_forward_group = group
        self.post_forward_args: Optional[tuple[str, int, int]] = None if group is None else (
            group.group_name, group.size(), group.rank())

    def set_divide_factor(self, factor: float) -> None:
        """See ``FSDPModule.set_gradient_divide_factor``: the factor is part
        of each parameter's ShardSpec, which both paths divide by."""
        for p in self.fsdp_params:
            p.spec = dataclasses.replace(p.spec, divide_factor=factor)
        self.specs = [p.spec for p in self.fsdp_params]

    def set_reduce_buckets(self, bucket_bytes: int) -> None:
        """Cut the gradients' reduction into buckets of at most ``bucket_bytes``
        (``reduces.byte_buckets``; [Note: replicate's buckets] in replicate.py)."""
        self.reduce_buckets = byte_buckets(self.fsdp_params, bucket_bytes)
        bucket_of = [0] * len(self.fsdp_params)
        for b, indices in enumerate(self.reduce_buckets):
            for i in indices:
                bucket_of[i] = b
        self._bucket_of = tuple(bucket_of)

    @property
    def reshards_after_forward(self) -> bool:
        """See [Note: The reshard rule] in core/rules.py."""
        return rules.reshards_after_forward(self.reshard_after_forward, self.outermost)

    @property
    def label(self) -> str:
        """The module's name under its root, for messages ("<root>" for the root)."""
        return self.fqn or "<root>"

    @property
    def identity(self) -> tuple:
        """What names this group the same on every rank, for the checks of
        [Note: Agreeing on collectives]: its number among the groups of its
        checker (``fully_shard`` order on the checker's ranks; not the key,
        which counts every ``fully_shard`` call in the process and so differs
        between ranks that also shard models on subgroups of their own) and
        its parameters' full shapes."""
        return (self.check_number, tuple(s.full_shape for s in self.specs))

    def forward_active(self) -> bool:
        """Whether the eager runtime is inside a forward of this group's root."""
        return self.ctx is not None and self.ctx.phase is Phase.FORWARD

    def check_materialized(self, module_fqn: str) -> None:
        """FSDP2's error for shards still on the meta device, all of the group's
        at once, named under the root (the group's module is ``module_fqn``;
        [Note: Meta-device init] in param.py)."""
        def name(p: FSDPParam) -> str:
            return f"{module_fqn}.{p.fqn}" if module_fqn else p.fqn

        names = [name(p) for p in self.fsdp_params if p.on_meta]
        elsewhere = [(name(p), p.local_shard().device)
                     for p in self.fsdp_params if p.offload and not p.on_meta and p.local_shard().device.type != "cpu"]
        if elsewhere:  # (FSDP2's words: [Note: CPU offload] in policy.py)
            raise RuntimeError(
                "FSDP parameters should be materialized on CPU when enabling CPU offloading. For example, load a "
                'CPU state dict or call module.to_empty(device="cpu"). Found following parameters on non-CPU '
                f"device: {elsewhere}")
        for p in self.fsdp_params:
            p.pin_offloaded()
        if names:
            raise RuntimeError(
                "FSDP parameters should be materialized from meta device before training, but the "
                f"following were still on meta device: {names}\nAfter building the model under "
                "torch.device('meta') and fully_shard, call model.to_empty(device=...) and initialize it "
                "(reset_parameters() / init_weights(), or load a checkpoint) before the first forward.")

    def before_marker_collective(self, op: str, param_index: int) -> None:
        """A marker of this group that no pass lowered is about to issue ``op``
        eagerly (core/ops.py): agree on it first."""
        if self.checker is not None:
            what = (f"the per-parameter {op} of {self.label}'s parameter {param_index}" if param_index >= 0
                    else f"the {op} of {self.label}'s bucket")
            self.checker.check(Checkpoint(
                COLLECTIVE, self.checker.step, stable_code(op, self.identity, param_index), what))

    def issuing_gather(self) -> contextlib.AbstractContextManager:
        """Where a marker op issues this group's gather, in flight (core/ops.py):
        on the root's gather stream, as ``unshard`` issues it."""
        streams = self._streams()
        return streams.on_gather() if streams is not None else contextlib.nullcontext()

    # -- all-gather ----------------------------------------------------------
    def unshard(self, async_op: bool = False) -> None:
        """Issue the group's all-gather (if sharded); with ``async_op=False`` also wait."""
        if self.state is ShardedState.SHARDED and all(p.reads_shard for p in self.fsdp_params):
            for p in self.fsdp_params:  # see [Note: A group of one reads its shards] in param.py
                p.alloc_unsharded()
            self.state = ShardedState.UNSHARDED
        streams, pending = self._streams(), None
        if self.state is ShardedState.SHARDED_POST_FORWARD:
            part, self._post_forward_part = self._post_forward_part, None
            assert part is not None and self.post_forward_group is not None
            self._gather_check = self._issue_check("post-forward all-gather")
            pending = all_gather_part(part, self.post_forward_group, streams=streams)
        elif self.state is ShardedState.SHARDED:
            self._gather_check = self._issue_check("all-gather")
            if self.extension_gather is not None:
                pending = self.extension_gather.all_gather(self.process_group, streams)
            else:
                pending = all_gather_bucket(
                    [p.canonical_shard() for p in self.fsdp_params], self.specs, self.process_group,
                    [p.param_dtype for p in self.fsdp_params], streams=streams,
                    device=self.fsdp_params[0].compute_device if self.fsdp_params[0].offload else None,
                )
        if pending is not None:  # (issued on the gather stream: [Note: Streams and events])
            self._pending_gather = streams.joined(pending) if streams is not None else pending
            self.state = ShardedState.GATHERING
        if not async_op:
            self.wait_for_unshard()

    def wait_for_unshard(self) -> None:
        if self.state is not ShardedState.GATHERING:
            return
        if self._gather_check is not None:
            check, self._gather_check = self._gather_check, None
            check.wait()
        flat = self._pending_gather.wait()
        self._pending_gather = None
        if self.post_forward_args is not None and self.forward_active() and self.reshards_after_forward:
            _, size, rank = self.post_forward_args
            self._post_forward_part = post_forward_part(EAGER, flat, size, rank)
        if self.extension_gather is not None:
            self.extension_gather.copy_out(flat)
        else:
            dests = [p.alloc_unsharded() for p in self.fsdp_params]
            with contextlib.ExitStack() as stack:
                for d in dests:  # autograd's saved views must not see a version bump
                    stack.enter_context(torch.autograd._unsafe_preserve_version_counter(d))
                copy_out_all_gather(flat, self.specs, [p.to_canonical(d) for p, d in zip(self.fsdp_params, dests)])
        self.state = ShardedState.UNSHARDED

    def reshard(self) -> None:
        if self.state is ShardedState.GATHERING:
            self.wait_for_unshard()  # the collective was issued on every rank: finish it
        for p in self.fsdp_params:
            p.free_unsharded()
        self._post_forward_part = None
        self.state = ShardedState.SHARDED

    # -- forward -------------------------------------------------------------
    def pre_forward(self, lazy_buckets: bool = False) -> None:
        """Gather and expose the unsharded parameters. ``lazy_buckets``: the
        module runs in a plain eager call (no compiled frame around it), so
        each reduce bucket's autograd function may wait for the first read of
        one of its parameters ([Note: replicate's buckets] in replicate.py)."""
        self.unshard()
        shards = [p.sharded for p in self.fsdp_params]
        wants_grad = torch.is_grad_enabled() and any(s.requires_grad for s in shards)
        if self._iter_views is None or (wants_grad and not self.needs_grad_sync):  # (views made under no_grad)
            if wants_grad:
                self._iter_views = [None] * len(shards)
                if len(self.reduce_buckets) == 1 or not lazy_buckets:
                    for b in range(len(self.reduce_buckets)):
                        self._apply_bucket(b)
                self.needs_grad_sync = True
            else:
                self._iter_views = tuple(static_view(p.to_compute(p.unsharded.view_as(p.unsharded)))
                                         for p in self.fsdp_params)
        self.exposed_views = self._iter_views

    def view_of(self, index: int) -> torch.Tensor:
        """Parameter ``index``'s unsharded view for the module's eager code
        (its bucket's autograd function applied at the first read: [Note:
        replicate's buckets] in replicate.py)."""
        assert self.exposed_views is not None
        view = self.exposed_views[index]
        if view is None:
            self._apply_bucket(self._bucket_of[index])
            view = self.exposed_views[index]
        return view

    def _apply_bucket(self, bucket: int) -> None:
        indices = self.reduce_buckets[bucket]
        differentiable = any(self.fsdp_params[i].sharded.requires_grad for i in indices)
        anchor = self._grad_anchor(self.fsdp_params[indices[0]].device) if differentiable else None
        with torch.enable_grad():  # (pre_forward decided: a first read under no_grad must not lose the gradient)
            outs = UnshardFn.apply(self, bucket, anchor)
        if differentiable:
            self._applied_buckets.add(bucket)
        for i, out in zip(indices, outs):
            self._iter_views[i] = static_view(self.fsdp_params[i].to_compute(out))

    def _grad_anchor(self, device: torch.device) -> torch.Tensor:
        """The leaf that makes ``UnshardFn``'s outputs differentiable ([Note:
        Eager autograd through UnshardFn]); made once."""
        if self._anchor is None or self._anchor.device != device:
            self._anchor = torch.empty(0, device=device, requires_grad=True)
        return self._anchor

    def post_forward(self, reshard: bool, backward_follows: bool = True) -> None:
        self.exposed_views = None
        if reshard:
            part = self._post_forward_part
            self.reshard()
            if part is not None and backward_follows:  # ([Note: Resharding to a smaller group] in groups.py)
                self._post_forward_part, self.state = part, ShardedState.SHARDED_POST_FORWARD

    # -- backward ------------------------------------------------------------
    def pre_backward(self) -> None:
        self.kept_for_backward = False
        if not self.unshard_in_backward:
            return
        self.unshard()
        # Activation checkpointing recomputes the module's forward during its
        # backward: it reads the parameters that this iteration's forward read
        # (tests/test_eager_parity.py::test_activation_checkpointing).
        self.exposed_views = self._iter_views

    def post_backward(self, grads: tuple[Optional[torch.Tensor], ...], bucket: int = 0) -> None:
        """Every gradient of reduce bucket ``bucket`` exists: issue its
        reduction (not awaited here); after the group's last bucket, reshard."""
        self._reduced_buckets.add(bucket)
        if self._reduced_buckets >= self._applied_buckets:  # (a frozen bucket never runs its backward)
            self.exposed_views = None
            if self.reshard_after_backward:
                self.reshard()
        bucket_params = [self.fsdp_params[i] for i in self.reduce_buckets[bucket]]
        grads = tuple(p.canonical_grad(g) for p, g in zip(bucket_params, grads))  # ([Note: Shard dims])
        if not self.reduce_grads:  # see [Note: Gradient accumulation without sync]
            for p, g in zip(bucket_params, grads):
                p.accumulate_unsharded_grad(g)
            return
        owned = [(p, p.take_unsharded_grad(g)) for p, g in zip(bucket_params, grads)]
        if self.reduce_unused:
            owned = [(p, g if g is not None or not p.sharded.requires_grad else
                      torch.zeros(p.spec.full_shape, dtype=p.reduce_dtype, device=p.device))
                     for p, g in owned]
        owned = [(p, g) for p, g in owned if g is not None]
        if not owned:
            return
        params = [p for p, _ in owned]
        check = self._issue_check("reduce-scatter" if self.process_group.size() > 1 else "all-reduce", bucket)
        # take_unsharded_grad cast them to the reduce dtype: see [Note: Mixed precision].
        pending = reduce_bucket([g for _, g in owned], [p.spec for p in params], self.reduce_group,
                                self.reduce_by_all_to_all, self.replicate_group, streams=self._streams())
        # A module run twice before one backward reduces once per forward:
        # each reduce is kept until finished (earlier ones first), none
        # replaces another (tests/test_fsdp2_api.py::test_nested_modules_compiled_in_place).
        self.reduces.pending.append(PendingReduce(pending, check, params))
        if self.ctx is not None:
            self.ctx.on_reduce_issued(self)

    def finish_grad_sync(self) -> None:
        """Await the issued reductions (oldest first) and accumulate the
        averaged shards into ``.grad`` (offloaded ones at ``end_iteration``:
        [Note: Offloaded gradients land at the end of backward] in reduces.py)."""
        self.reduces.finish(self._streams())

    def _streams(self) -> Optional["CommStreams"]:
        """The root's side streams ([Note: Streams and events]); None before lazy init."""
        return self.ctx.streams if self.ctx is not None else None

    def _issue_check(self, op: str, bucket: int = 0) -> Optional[PendingCheck]:
        """Announce this group's next eager collective (of reduce bucket
        ``bucket``); see [Note: Agreeing on collectives]."""
        if self.checker is None:
            return None
        if len(self.reduce_buckets) > 1:
            op = f"{op} of bucket {bucket}"
        what = f"the eager {op} of {self.label} ({len(self.fsdp_params)} parameters)"
        return self.checker.issue(Checkpoint(COLLECTIVE, self.checker.step, stable_code(op, self.identity), what))

    def abandon_iteration(self) -> None:
        """After an exception aborted the iteration (``reset_iter_state``): an
        issued reduction is awaited (every rank issued it) and its result
        dropped, as FSDP2 drops a failed iteration's gradients; an issued
        gather is finished and freed; nothing of the iteration is kept."""
        self.reduces.abandon()
        self._applied_buckets, self._reduced_buckets = set(), set()
        self.reshard()
        self.kept_for_backward = False
        self.exposed_views = None
        self._iter_views = None
        self.needs_grad_sync = False

    def begin_iteration(self) -> None:
        """A root forward begins a new iteration: this group's autograd views
        and gradient bookkeeping start afresh."""
        self.drop_kept()
        self.reduces.drop_copies()
        if self.state is ShardedState.SHARDED_POST_FORWARD:  # ([Note: Resharding to a smaller group] in groups.py)
            self.reshard()
        self._iter_views = None
        self._applied_buckets = set()
        self.needs_grad_sync = False

    def drop_kept(self) -> None:
        """Free a gather kept for a backward still to come: a new forward may
        follow a change of the parameters ([Note: Prefetch order] in context.py)."""
        if self.kept_for_backward:
            self.reshard()
            self.kept_for_backward = False

    @property
    def backward_done(self) -> bool:
        """Every bucket this iteration's forward applied has run its backward."""
        return bool(self._applied_buckets) and self._reduced_buckets >= self._applied_buckets

    def end_backward_pass(self) -> None:
        """A backward ended without ending the iteration (manual finalization):
        the next backward's buckets are counted afresh; its finished
        reduces land ([Note: Offloaded gradients land at the end of backward])."""
        self._reduced_buckets = set()
        self.reduces.land()

    def reduce_kept_grads(self) -> None:
        """Issue the reduction of every gradient kept without sync (sync is on
        again): ``finalize_backward`` after several backwards."""
        for b, indices in enumerate(self.reduce_buckets):
            params = [self.fsdp_params[i] for i in indices]
            if any(p.kept_grad() is not None for p in params):
                self.post_backward((None,) * len(params), b)

    def end_iteration(self) -> None:
        """A backward ended: finish its communication, free unsharded memory.
        The autograd views stay to the next root forward, for a later backward
        of the same forward ([Note: Several backwards of one forward] in context.py)."""
        self.finish_grad_sync()
        self.reduces.land()  # (the root landed every group before: nothing, unless this finish found one)
        keep = self.kept_for_backward and self.needs_grad_sync and not self.backward_done
        if (self.reshard_after_backward or not self.needs_grad_sync) and not keep:
            self.reshard()
        self.kept_for_backward = keep
        self._reduced_buckets = set()
        self.exposed_views = None
