"""One parameter's lifecycle: sharded at rest, unsharded around its module's compute.
What a read of ``module.<name>`` returns is [Note: Parameter property] in
module_class.py; the shard dims, [Note: Shard dims] in core/layout.py.

[Note: Parameters are DTensors]
The registered parameter is a ``DTensor`` (``Shard(0)`` on the module's mesh)
holding this rank's rows of the parameter ([Note: Shard layout] in core/layout.py),
so clipping, DCP and the distributed state-dict API treat it as the shard it
is. The eager runtime packs the local tensors (padded to the common shard shape)
into its all-gather and writes the reduced gradients as DTensor ``.grad``. A
traced read feeds the marker ``to_local()``; the marker ops pad and cut the rows
themselves, so every rank's graph has the same structure (see [Note:
Rank-independent graphs]) and AOTAutograd wraps the local gradient into a
DTensor ``.grad``. Tested by tests/test_dtensor_state.py.
``torch.nn.utils.parametrize`` is avoided because it renames state-dict keys.

[Note: FSDP over DTensor parameters]
Tensor parallelism first (torch's ``parallelize_module`` on the ``tp`` dim
of a ``(dp, tp)`` mesh), then ``fully_shard(block, mesh=mesh["dp"])``, as
torchtitan applies them. A parameter that arrives as a DTensor is sharded
as FSDP2 shards it: FSDP shards, gathers and reduces its *local* tensor
over ``dp`` (``full_shape`` is that tensor's shape; ``global_shape`` the
DTensor's), and the registered DTensor lives on the two meshes
concatenated, placed ``(Shard(d), <its own placement>)`` (HSDP:
``Replicate()`` in front), with ``_StridedShard(d, split_factor)`` where
its own placement already splits dim ``d`` (column-wise weights), so DCP,
``clip_grad_norm_`` and the state-dict API see what FSDP2 makes, and
checkpoints load across the two. What the module's code reads is
``to_compute``: the gathered local tensor wrapped back into a DTensor with
the parameter's own placements (``from_local``, differentiable), in eager
and in graphs alike; its gradient comes back as the local tensor's,
redistributed to those placements first (a sequence-parallel norm's
partial gradient is summed over ``tp`` there), and is reduced over ``dp``
as any other. Under compile, Dynamo traces tensor parallelism's
collectives into the same graph as ours: [Note: Foreign collectives] in
passes/collectives.py says how they are scheduled. One parallel dim only (FSDP2
on most releases; 2-D EP x TP is refused); the two meshes must be named
dims of one parent (else a ValueError that says how to build them). Under
``dp_mesh_dims`` a parameter comes as a DTensor on the whole SPMD mesh
(``Replicate()`` on the data-parallel dims; torchtitan's ``full_dtensor``):
it stays there, as FSDP2 keeps it. FSDP's placement replaces ``Replicate()``
on the shard dim (``_StridedShard`` where a later dim splits the same tensor
dim), and the compute view is a DTensor on that mesh whose gradient is asked
``Partial()`` over the data-parallel dims (``grad_placements``): tensor
parallelism's reductions run in its backward, the data-parallel sum is the
reduce-scatter's alone (FSDP2: ``_dp_dim_indices``); placement.py decides
all three layouts (tests/test_fsdp2_215.py::test_dp_mesh_dims_with_tensor_parallelism).
Tested by tests/test_tensor_parallel.py. Found there, in torch itself and
without FSDP: a model whose embedding is ``RowwiseParallel`` (torchtitan's
plan) with its blocks compiled on their own fails in backward (``'Tensor'
object has no attribute '_local_tensor'`` in DTensor's redistribute, on
2.13 and 2.15), and FSDP2 trains the same model 0.03 away from the
reference; whole-model compile and eager are right, so the per-block test
puts TP on the blocks' matmuls only.

[Note: Meta-device init]
``fully_shard`` accepts parameters on ``meta``: each shard is a meta tensor of
the local shape, so no rank ever holds a full parameter. ``module.to_empty(device=...)``
then swaps every registered DTensor for one with real (uninitialized) local
storage; ``torch.utils.swap_tensors`` keeps the parameter object, so nothing
here needs updating (``local_shard()`` reads the DTensor's local tensor each
time). User init (``reset_parameters()``, ``init_weights()``) reads parameters
outside forward, so it gets the DTensors and writes each rank's rows in place;
a DCP load fills them from a checkpoint. A forward while a shard is still on
``meta`` raises FSDP2's error (``FSDPParamGroup.check_materialized``). Tested by tests/test_meta_init.py.
"""
from __future__ import annotations

from typing import Optional, Protocol, Sequence

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from compiled_fsdp.core import compat, registry
from compiled_fsdp.core.layout import EAGER, ShardSpec, from_canonical, reduce_input, to_canonical
from compiled_fsdp.runtime.annotated import annotated_layout
from compiled_fsdp.runtime.ext_gather import Extension
from compiled_fsdp.runtime.extension import compiled_path
from compiled_fsdp.runtime.placement import compute_device, registered_layout
from compiled_fsdp.runtime.policy import CPUOffloadPolicy, MixedPrecisionPolicy
from compiled_fsdp.runtime.registry import RUNTIME


def sharded_tensor(param: torch.Tensor) -> torch.Tensor:
    """What FSDP shards of a parameter: the parameter, or a DTensor
    parameter's local tensor ([Note: FSDP over DTensor parameters])."""
    return param._local_tensor if isinstance(param, DTensor) else param


class ParamOwner(Protocol):
    """What a parameter asks of its group (``param_group.FSDPParamGroup``),
    named here so that this module never imports the group's."""

    name: str
    exposed_views: Optional[Sequence[Optional[torch.Tensor]]]

    def view_of(self, index: int) -> torch.Tensor:
        """The gathered view of parameter ``index`` its module's forward reads."""

    def forward_active(self) -> bool:
        """Whether the eager runtime is inside a forward of the group's root."""

class FSDPParam:
    """A managed parameter: its shard (the registered ``nn.Parameter``, a
    ``DTensor``) and its unsharded buffer, whose storage is freed while
    resharded."""

    def __init__(
        self,
        param: nn.Parameter,
        owners: list[tuple[nn.Module, str]],
        fqn: str,
        mesh: DeviceMesh,
        rank: int,
        mp_policy: MixedPrecisionPolicy,
        shard_size: Optional[int] = None,
        shard_dim: int = 0,
        offload: Optional[CPUOffloadPolicy] = None,
        spmd_mesh: Optional[DeviceMesh] = None,
        spmd_dp_names: tuple[str, ...] = (),
    ) -> None:
        self.fqn = fqn
        self.owners = owners
        self.mesh = mesh
        self.shard_dim = shard_dim  # see [Note: Shard dims]
        # See [Note: FSDP over DTensor parameters]: FSDP shards, gathers and
        # reduces the DTensor's local tensor; ``full_shape`` is that tensor's.
        # A plain parameter with spmd_types annotations is the DTensor they
        # describe, computed with as a plain tensor ([Note: spmd_types parameters]).
        self.annotated = annotated_layout(fqn, param, spmd_mesh, spmd_dp_names)
        if self.annotated is not None and self.annotated.placements is not None:
            param = self.annotated.as_dtensor(param, spmd_mesh)
        self.dtensor_spec: Optional[DTensorSpec] = param._spec if isinstance(param, DTensor) else None
        self.global_shape = tuple(param.shape)
        requires_grad = param.requires_grad
        param = sharded_tensor(param)
        self.full_shape = tuple(param.shape)
        # A 2-D mesh is HSDP's (replicate, shard): sharded over its last dim.
        # ``replicate``'s 1-D mesh holds the replicas of a group of one
        # (``shard_size`` 1): [Note: replicate] in replicate.py.
        shard_size = mesh.size(mesh.ndim - 1) if shard_size is None else shard_size
        replicas = mesh.size(0) if mesh.ndim == 2 else mesh.size() // shard_size
        self.spec = ShardSpec(tuple(self.to_canonical(param).shape), shard_size, replicas=replicas)
        self.local_rows = self.spec.local_dim0(rank)
        self.shard_rank = rank
        self.orig_dtype = param.dtype
        # See [Note: Mixed precision] in policy.py.
        mp_policy = mp_policy.for_param(param)
        self.mp_policy = mp_policy  # (resolved for this parameter: ``follow_dtype``)
        self.param_dtype = mp_policy.compute_dtype(param.dtype)
        self.reduce_dtype = mp_policy.grad_reduce_dtype(param.dtype)
        # (on a dp_mesh_dims mesh, grad_placements keeps its gradient Partial over the dp dims)
        self.spmd_mesh, self.spmd_placements, self.grad_placements = registered_layout(
            fqn, mesh, self.spec, shard_dim, self.dtensor_spec, spmd_mesh)
        self._dtensor_specs: dict[torch.dtype, DTensorSpec] = {}  # (``to_dtensor``'s, by dtype)
        self.offload = offload is not None  # see [Note: CPU offload] in policy.py
        self.pin = self.offload and offload.pin_memory and torch.accelerator.is_available()
        self.compute_device = compute_device(mesh.device_type)
        with torch.no_grad():
            local = self.local_of(param.detach(), rank)
            if offload is not None and not local.is_meta:
                local = local.cpu().pin_memory() if self.pin else local.cpu()
        self.sharded = nn.Parameter(self.to_dtensor(local), requires_grad=requires_grad)
        RUNTIME.shards[id(self.sharded)] = self
        # See [Note: All-gather extensions] in ext_gather.py.
        self.extension = self._extension(local, owners[0][0], mp_policy)
        self.unsharded: Optional[torch.Tensor] = None
        # FSDPModule.set_keep_unsharded_storage: reshard keeps the bytes.
        self.keep_unsharded_storage = False
        # Its ``.grad`` is the full gradient summed over micro-batches without
        # sync, on both paths; see [Note: Accumulation without sync in graphs]
        # in core/ops.py and [Note: Gradient accumulation without sync] in module.py.
        self.grad_sink: Optional[torch.Tensor] = None
        self.group: Optional[ParamOwner] = None
        self.index = -1
        self.bucket_offset = 0  # its columns in the group's bucket ([Note: Bucket layout])
        for module, name in owners:
            module._parameters[name] = self.sharded

    def _extension(self, local: torch.Tensor, module: nn.Module, mp_policy: MixedPrecisionPolicy
                   ) -> Optional[Extension]:
        """The extension's state, if ``local`` has one (``check_extensions``
        in validation.py refused what is not supported, before any sharding)."""
        if not hasattr(local, "fsdp_pre_all_gather"):
            return None
        mesh = self.mesh  # HSDP: the hook's mesh is the shard dim's, FSDP2's shard_mesh_from_root
        return Extension(local, module, mesh if mesh.ndim == 1 else mesh[mesh.mesh_dim_names[-1]],
                         torch.Size(self.global_shape), _contiguous_strides(self.global_shape), mp_policy)

    def to_canonical(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (the parameter, its shard or a gradient, in the parameter's
        layout) with the shard dim first: a view ([Note: Shard dims])."""
        return to_canonical(t, self.shard_dim)

    def from_canonical(self, t: torch.Tensor) -> torch.Tensor:
        """``to_canonical`` undone: a view."""
        return from_canonical(t, self.shard_dim)

    def local_of(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """``rank``'s piece of ``full`` (a tensor of the parameter's shape), as
        its DTensor holds it: a new contiguous tensor."""
        local = self.from_canonical(self.spec.local(self.to_canonical(full), rank))
        return local.contiguous()

    def canonical_grad(self, grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """A gradient of the unsharded parameter in the canonical layout, contiguous."""
        if grad is None or self.shard_dim == 0:
            return grad
        return self.to_canonical(grad).contiguous()

    def canonical_shard(self) -> torch.Tensor:
        """The local shard with the shard dim first."""
        return self.to_canonical(self.sharded._local_tensor)

    def pin_offloaded(self) -> None:
        """Pin an offloaded shard that is not (materialized after ``fully_shard``:
        ``to_empty(device="cpu")``), as ``fully_shard`` pins one it shards
        ([Note: CPU offload] in policy.py)."""
        local = self.local_shard()
        if self.pin and local.device.type == "cpu" and not local.is_pinned():
            self.sharded._local_tensor = local.pin_memory()

    @property
    def gather_device(self) -> Optional[str]:
        """Where a graph's gather copies the shard to first: under CPU
        offload the compute device ([Note: CPU offload in graphs] in
        passes/lowering.py); None otherwise."""
        return str(self.compute_device) if self.offload else None

    @property
    def device(self) -> torch.device:
        """Where the unsharded parameter, its gradient sink and kept gradients live."""
        return self.compute_device if self.offload else self.local_shard().device

    def to_dtensor(self, local: torch.Tensor) -> DTensor:
        """The registered DTensor over this rank's piece ``local``, where it
        is (no copy, no communication, not differentiable), placed as
        ``_spmd_layout`` says: DTensor's own constructor over a spec kept per
        dtype, as FSDP2's ``to_sharded_dtensor``. Not ``from_local``, which
        moves a tensor to its mesh's device: a CPU-offloaded shard under
        NCCL went to the GPU (tests/test_offload.py::
        test_offloaded_shards_stay_on_the_cpu_under_a_cuda_mesh), and it took
        56 us a call on the CPU, a ``.grad`` a parameter each step."""
        spec = self._dtensor_specs.get(local.dtype)
        if spec is None:
            full = self.global_shape
            meta = TensorMeta(torch.Size(full), _contiguous_strides(full), local.dtype)
            spec = self._dtensor_specs[local.dtype] = DTensorSpec(
                self.spmd_mesh, tuple(self.spmd_placements), tensor_meta=meta)
        return DTensor(local, spec, requires_grad=local.requires_grad)

    def to_compute(self, unsharded: torch.Tensor) -> torch.Tensor:
        """What the module's code reads: the unsharded tensor, or for a
        DTensor parameter a DTensor over it with the parameter's own
        placements (differentiable: its gradient comes back as the local
        tensor's, redistributed to those placements); for an annotated one,
        that DTensor's plain local tensor ([Note: spmd_types parameters])."""
        spec = self.dtensor_spec
        view = unsharded
        if spec is not None:
            full = self.global_shape
            extra = {} if self.grad_placements is None else {"grad_placements": self.grad_placements}
            view = DTensor.from_local(unsharded, spec.mesh, spec.placements, run_check=False,
                                      shape=torch.Size(full), stride=_contiguous_strides(full), **extra)
        return view if self.annotated is None else self.annotated.plain(view)

    def local_shard(self) -> torch.Tensor:
        """This rank's rows: the tensor the registered DTensor holds, which the
        optimizer updates in place."""
        return self.sharded._local_tensor

    def graph_shard(self) -> torch.Tensor:
        """``local_shard`` as a compiled graph reads it: a float8 weight's
        high-precision rows ([Note: Float8 weights cast before their gather in
        graphs] in passes/cast_gather.py)."""
        local = self.local_shard()
        return local._tensor if self.extension is not None and self.extension.casts_in_graph else local

    def add_grad(self, grad: torch.Tensor) -> None:
        """Accumulate a reduced gradient of the local rows (canonical: [Note:
        Shard dims]) into ``.grad`` (``land_grad``). Under CPU offload it is
        copied to the host first, blocking, so the optimizer may read it at
        once ([Note: CPU offload] in policy.py; the eager runtime's copies go
        by ``grad_to_host`` where the device has streams)."""
        grad = self.from_canonical(grad)
        moved = self.offload and grad.device.type != "cpu"
        if moved:
            grad = grad.to("cpu", memory_format=torch.contiguous_format)
        self.land_grad(grad, owned=moved)

    def grad_to_host(self, grad: torch.Tensor) -> torch.Tensor:
        """A reduced gradient of the local rows (canonical) copied to the host,
        not blocking (pinned where the policy pins), for ``land_grad`` once
        the copy is done ([Note: Offloaded gradients land at the end of
        backward] in reduces.py)."""
        grad = self.from_canonical(grad)
        host = torch.empty(grad.shape, dtype=grad.dtype, device="cpu", pin_memory=self.pin)
        return host.copy_(grad, non_blocking=True)

    def land_grad(self, grad: torch.Tensor, owned: bool = False) -> None:
        """Set or accumulate ``grad`` (this rank's rows, laid out as the
        parameter; ``owned``: kept as it is, not cloned) as ``.grad`` (a
        DTensor with the parameter's spec), then run the parameter's
        post-accumulate-grad hooks, as FSDP2 does once it sets a reduced
        gradient (optimizer in backward: tests/test_fsdp2_215.py::
        test_optimizer_in_backward). Autograd does not run them: it never
        accumulates into the sharded parameter here."""
        if self.sharded.grad is None:
            self.sharded.grad = self.to_dtensor(grad if owned else grad.clone(memory_format=torch.contiguous_format))
        else:
            self.sharded.grad._local_tensor += grad
        with torch.no_grad():  # (as FSDP2's reduce: a hook may update the parameter in place)
            for hook in compat.post_accumulate_grad_hooks(self.sharded):
                hook(self.sharded)

    def ensure_grad_sink(self) -> torch.Tensor:
        """The gradient sink (created once, outside any traced code): a leaf of
        the full shape with zero strides, so it holds one element."""
        if self.grad_sink is None:
            full = self.spec.full_shape
            self.grad_sink = torch.empty_strided(
                full, (0,) * len(full), dtype=self.reduce_dtype, device=self.device
            ).requires_grad_()
        return self.grad_sink

    def unsharded_grad_dtype(self) -> Optional[torch.dtype]:
        """The dtype the eager backward hands this parameter's gradient over in
        (None: as autograd produced it), as FSDP2 2.15's unsharded parameter
        takes it during a backward ([Note: Mixed precision] in policy.py): as
        produced where the reduce dtype is wider than the compute dtype (an
        fp32 gradient of a bf16 weight is not rounded; two bf16 ones add in
        bf16), else cast to the reduce dtype."""
        if not self.sharded.requires_grad or self.reduce_dtype.itemsize > self.param_dtype.itemsize:
            return None
        return self.reduce_dtype

    def kept_grad(self) -> Optional[torch.Tensor]:
        """The full gradient kept without sync, in the reduce dtype, or None."""
        return None if self.grad_sink is None else self.grad_sink.grad

    def accumulate_unsharded_grad(self, grad: Optional[torch.Tensor]) -> None:
        """Add ``grad`` to the gradient kept without sync."""
        if grad is None:
            return
        sink = self.ensure_grad_sink()
        if sink.grad is None:
            sink.grad = grad.detach().to(self.reduce_dtype, copy=True)
        else:
            sink.grad += grad

    def take_unsharded_grad(self, grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The full gradient to reduce now, in the reduce dtype: ``grad`` added to
        what was kept without sync (which is dropped)."""
        kept = self.kept_grad()
        if kept is not None:
            self.grad_sink.grad = None
        if grad is None:
            return kept
        return reduce_input(EAGER, grad, kept, self.reduce_dtype)

    def drop_kept_grad(self) -> None:
        """Forget the kept gradient (a compiled backward has taken it)."""
        if self.grad_sink is not None:
            self.grad_sink.grad = None

    def reset_sharded_param(self) -> None:
        """After ``load_state_dict(assign=True)`` or ``module._apply`` put another
        tensor where our parameter was registered: copy its local rows into ours
        and register our parameter again, so the optimizer and the collectives
        keep seeing one tensor. Also at the root's lazy init, for a parameter
        the user's init assigned anew, whole (``module.w = nn.Parameter(...)``
        after ``fully_shard``, as FSDP2 allows): this rank's rows of it, into
        a shard still on meta as into one with storage."""
        module, name = self.owners[0]
        current = module._parameters.get(name)
        if current is self.sharded or current is None:
            return
        local = current.to_local() if isinstance(current, DTensor) else current
        mine = self.local_shard()
        if tuple(local.shape) != tuple(mine.shape) and self.dtensor_spec is None and self.annotated is None \
                and tuple(current.shape) == self.full_shape:  # (a whole one, or placed otherwise)
            whole = current.full_tensor() if isinstance(current, DTensor) else current
            local = self.local_of(whole.detach(), self.shard_rank)
        if tuple(local.shape) != tuple(mine.shape):
            raise ValueError(
                f"compiled_fsdp: parameter {self.fqn!r} was replaced by a tensor of shape "
                f"{tuple(current.shape)}; expected a DTensor shard of {self.full_shape}."
            )
        with torch.no_grad():
            if mine.is_meta:  # (ours never held values: the new one is the parameter, as in FSDP2)
                if not (isinstance(current, DTensor) and current.to_local().shape == mine.shape
                        and current.dtype == mine.dtype and current.placements == self.sharded.placements
                        and current.device_mesh == self.sharded.device_mesh):
                    raise ValueError(
                        f"compiled_fsdp: parameter {self.fqn!r}, still on meta, was replaced after fully_shard "
                        f"by a {type(current).__name__} of shape {tuple(current.shape)} and dtype {current.dtype}; "
                        f"it becomes the parameter only as a DTensor placed as the old one "
                        f"({self.sharded.placements}, {mine.dtype}): compute it from the sharded parameters, "
                        "or materialize the module with to_empty() and initialize the parameter in place.")
                RUNTIME.shards.pop(id(self.sharded), None)
                self.sharded = current
                RUNTIME.shards[id(current)] = self
                registry.CORE.backward_gathers.forget()
            else:
                mine.copy_(local)
        for m, n in self.owners:
            m._parameters[n] = self.sharded

    def follow_dtype(self) -> bool:
        """[Note: module.to(dtype) after fully_shard]
        ``nn.Module._apply`` (``module.to(torch.float64)``, ``.double()``)
        casts the registered shard in place (``param.data = ...``), as for
        FSDP2's: the dtypes derived from it follow (compute and reduce, per
        the policy), and an unsharded buffer of the old dtype is dropped.
        Returns whether it changed. Tested by
        tests/test_fsdp2_api.py::test_to_dtype_after_fully_shard."""
        dtype = self.sharded.dtype
        if dtype == self.orig_dtype:
            return False
        if self.extension is not None:
            raise NotImplementedError(
                f"compiled_fsdp: {self.fqn!r} is a tensor subclass with an all-gather extension; casting it "
                "after fully_shard is not supported: cast the module before fully_shard.")
        self.orig_dtype = dtype
        self.param_dtype = self.mp_policy.compute_dtype(dtype)
        self.reduce_dtype = self.mp_policy.grad_reduce_dtype(dtype)
        self.unsharded = None
        self.grad_sink = None
        return True

    @property
    def on_meta(self) -> bool:
        """Whether this shard still has no storage ([Note: Meta-device init])."""
        return self.local_shard().is_meta

    # -- unsharded storage -------------------------------------------------
    @property
    def reads_shard(self) -> bool:
        """[Note: A group of one reads its shards]
        On a shard group of one rank (``replicate``, HSDP with shard size 1,
        ``fully_shard`` on a world of one) the shard is the whole parameter.
        Where it is also computed in its own dtype (no ``param_dtype`` cast),
        the unsharded buffer is the shard's own storage: nothing is gathered,
        copied or freed, so the module holds one copy of its parameters, not
        two (a gather into a second buffer used to keep both alive from
        forward to backward). Autograd's views of it share the parameter's
        version counter, which nothing bumps between forward and backward
        (the optimizer steps after). Tested by
        tests/test_hsdp.py::test_replicate_buckets_overlap_backward."""
        return (self.spec.world_size == 1 and self.param_dtype == self.orig_dtype and self.extension is None
                and not self.offload)

    def alloc_unsharded(self) -> torch.Tensor:
        """The unsharded buffer with its storage allocated (contents undefined,
        but for [Note: A group of one reads its shards]: the shard itself)."""
        if self.reads_shard:
            self.unsharded = self.local_shard().detach()
        elif self.unsharded is None:
            self.unsharded = torch.empty(self.full_shape, dtype=self.param_dtype, device=self.device)
        else:
            storage = self.unsharded.untyped_storage()
            nbytes = self.unsharded.numel() * self.unsharded.element_size()
            if storage.size() != nbytes:
                storage.resize_(nbytes)
        return self.unsharded

    def free_unsharded(self) -> None:
        """Free the unsharded storage. Autograd's saved views keep the tensor object
        but not the bytes; the next unshard refills the same storage in place."""
        if self.reads_shard:  # (the parameter's own storage)
            self.unsharded = None
        elif self.extension is not None:
            if not self.keep_unsharded_storage:
                self.extension.free()
        elif self.unsharded is not None and not self.keep_unsharded_storage:
            self.unsharded.untyped_storage().resize_(0)

    # -- what a read of ``module.<name>`` returns --------------------------
    def current_value(self) -> torch.Tensor:
        """See [Note: Parameter property]."""
        group = self.group
        if group is None:
            return self.sharded
        if group.exposed_views is not None:
            return group.view_of(self.index)
        if torch.compiler.is_dynamo_compiling():
            return compiled_path().traced_read(self)
        value = compiled_path().untraced_read(self)
        if value is not None:
            return value
        if group.forward_active():
            raise RuntimeError(
                f"compiled_fsdp: parameter {self.fqn!r} of fully sharded module {group.name} was read "
                "during another module's forward. Parameters are gathered only for their own module's "
                "forward; move this use into that module's forward, or let the parent own the parameter "
                "(do not apply fully_shard to that module separately)."
            )
        return self.sharded


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    return tuple(reversed(strides))
