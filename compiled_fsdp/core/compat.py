"""Every difference between the torch releases compiled_fsdp supports, decided once.

[Note: Supported torch releases]
compiled_fsdp runs on torch 2.11 through 2.15 (``SUPPORTED``). The rest of
the package calls what this module exports and never tests a torch version
or probes torch for an attribute itself (``tests/test_compat.py`` walks the
package's source to keep it so). Differences are found by feature detection;
the one version test is the range check at import, which names the supported
range instead of letting a user on another release crash deep in a trace.
What differs, and where each choice is used:

* The eager collective names: torch 2.13 renamed ``all_gather_into_tensor``
  and ``reduce_scatter_tensor`` to ``all_gather_single`` and
  ``reduce_scatter_single`` (pytorch#186123; the old names still work there,
  with a deprecation warning). ``all_gather_single`` and
  ``reduce_scatter_single`` below call whichever the installed torch has.
* DTensor's ``to_local`` backward: torch 2.11 materializes a missing
  gradient as zeros (2.12 added ``set_materialize_grads(False)`` there), so
  under compile a shard the graph gives no gradient (a micro-batch without
  gradient sync) ends with a zero ``.grad`` instead of ``None``.
  ``to_local_keeps_none_grads()`` says which; where it does not, the runtime
  puts ``None`` back at the end of that backward (compile/path.py).
* Dynamo's compile-end callbacks: torch 2.11-2.15 run them before
  decrementing the handler's count of pending compiles, so a callback that
  raises leaves the count at 1 and no callback runs again (and
  ``torch._dynamo.reset()`` fails). ``end_callback_raised`` puts it back.
* Dynamo's names for a module's hooks: 2.11 names a hook by its place in
  the hook dict's insertion order, which ``register_forward_pre_hook``'s
  ``prepend`` does not change; ``register_first_forward_pre_hook`` puts
  FSDP's pre-forward first on every release without reordering (on 2.11 a
  user's pre-hook registered before ``fully_shard`` failed the first compile).
* Dynamo's frame-strategy API (``set_code_exec_strategy``), the same on
  every release: ``never_a_frame`` keeps the hooks and the parameter
  property's getter from being compiled as frames of their own (on 2.15 the
  getter as a frame broke a second compiled model: [Note: The property as a
  frame] in runtime/param.py).
* Inductor's ``post_grad_custom_post_pass`` takes a list or tuple of passes
  from torch 2.12 on; torch 2.11 calls the value itself. ``post_grad_passes``
  and ``post_grad_value`` read and write it as a tuple on every release (on
  2.11 several passes become one ``ChainedGraphPass`` whose ``uuid`` combines
  theirs, so Inductor's cache stays keyed on each).
* Inductor's scheduler-level overlap pass (``simple_overlap``, on by default
  from torch 2.14, pytorch#184235): it moves collectives earlier and waits
  later by adjacent swaps. ``SIMPLE_OVERLAP`` says whether this torch has it
  (see [Note: Inductor's simple_overlap] in passes/pin.py for how the
  project's schedule and it share the graph).
* AOTAutograd's partitioner, when activation checkpointing recomputes a
  random op (dropout; on 2.12-2.13 also a zero-dropout SDPA), appends the
  saved rng states after the saved opaque objects, where the runtime expects
  tensors only (``functionalize_rng_ops`` skips the symints but not them).
  A DTensor parameter's mesh is such an object from torch 2.12 on (saved to
  rebuild its gradient), so the forward fails with "expected all
  tensors_saved_with_vc_check to be Tensors" (a torch bug, present through
  2.15). ``fix_rng_state_order`` wraps that function, only while the passes
  are installed (compile/install.py's windows) and restored after, to move
  the rng states before the opaque objects, in the forward's outputs and the
  backward's inputs alike; where they are in place already (2.11, no opaque
  object, a fixed torch) it changes nothing. Tested by
  tests/test_eager_parity.py::test_activation_checkpointing (aot_eager).
* ``DTensor.from_local(..., grad_placements=...)``: from torch 2.13 on
  (``from_local_takes_grad_placements``). Without it (2.11), parameters that
  come as DTensors on a ``dp_mesh_dims`` mesh are refused with a clear error
  ([Note: dp_mesh_dims] in runtime/validation.py).
* spmd_types annotations on plain parameters (torchtitan's default SPMD
  backend): torch 2.15's FSDP2 reads them (``dist._is_spmd_types_available``)
  and earlier releases ignore them; ``spmd_types_package()`` returns the
  package where this torch reads them, else None, and the runtime's hooks
  run inside ``no_spmd_typecheck()`` ([Note: spmd_types parameters] in
  runtime/annotated.py).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import warnings
import weakref
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

__all__ = [
    "SIMPLE_OVERLAP",
    "SUPPORTED",
    "all_gather_single",
    "check_supported",
    "cudagraph_unsafe_tags",
    "end_callback_raised",
    "fix_rng_state_order",
    "from_local_takes_grad_placements",
    "nested_compile_region",
    "never_a_frame",
    "post_grad_passes",
    "post_grad_value",
    "reduce_scatter_single",
    "no_spmd_typecheck",
    "spmd_types_package",
    "to_local_keeps_none_grads",
    "torch_release",
]

# [lowest, first unsupported): the releases the compat script tests (.ci/compat).
SUPPORTED: tuple[tuple[int, int], tuple[int, int]] = ((2, 11), (2, 16))
_ALLOW_ENV = "COMPILED_FSDP_ALLOW_UNSUPPORTED_TORCH"


def torch_release(version: Optional[str] = None) -> tuple[int, int]:
    """``(major, minor)`` of ``version`` (default: the installed torch), e.g.
    ``"2.15.0+cu132"`` -> ``(2, 15)``; ``"2.16.0.dev20261101"`` -> ``(2, 16)``."""
    text = torch.__version__ if version is None else version
    parts = str(text).split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        raise ValueError(f"cannot read a torch release from {text!r}") from None


def _range_text() -> str:
    (lo_maj, lo_min), (hi_maj, hi_min) = SUPPORTED
    return f"torch>={lo_maj}.{lo_min},<{hi_maj}.{hi_min}"


def check_supported(version: Optional[str] = None) -> None:
    """Raises ``ImportError`` naming the supported range if ``version`` (default:
    the installed torch) is outside it. Setting ``COMPILED_FSDP_ALLOW_UNSUPPORTED_TORCH=1``
    turns the error into a warning, for trying a release nobody has tested."""
    text = torch.__version__ if version is None else version
    release = torch_release(text)
    lo, hi = SUPPORTED
    if lo <= release < hi:
        return
    message = (
        f"compiled_fsdp supports {_range_text()}; this is torch {text}. "
        f"Install a supported release (for example `pip install 'torch>=2.11,<2.16'`), "
        f"or set {_ALLOW_ENV}=1 to try this one untested."
    )
    if os.environ.get(_ALLOW_ENV) == "1":
        warnings.warn(message, stacklevel=2)
        return
    raise ImportError(message)


# --- eager collectives (pytorch#186123 renamed them in 2.13) -----------------

_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_single(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
) -> Optional[dist.Work]:
    """``output[r * n:(r + 1) * n] = input`` of rank ``r``, for every rank of ``group``."""
    return _ALL_GATHER(output, input, group=group, async_op=async_op)


def reduce_scatter_single(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    async_op: bool = False,
) -> Optional[dist.Work]:
    """This rank's slice of ``input`` reduced over ``group`` into ``output``."""
    return _REDUCE_SCATTER(output, input, op=op, group=group, async_op=async_op)


# --- DTensor ----------------------------------------------------------------

@functools.lru_cache(1)
def has_streams(device: torch.device) -> bool:
    """Whether ``device`` is the current accelerator, with streams and events
    (``torch.accelerator``: CUDA, XPU, ...); the CPU has none."""
    if device.type == "cpu":
        return False
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return acc is not None and acc.type == device.type


def new_stream(device: torch.device) -> torch.Stream:
    """A new stream on ``device`` (usable as a context manager)."""
    return torch.Stream(device=device)


def current_stream(device: torch.device) -> torch.Stream:
    return torch.accelerator.current_stream(device)


def to_local_keeps_none_grads() -> bool:
    """Whether ``DTensor.to_local``'s backward passes a missing gradient on as
    ``None`` (rather than materializing zeros): asked of its backward directly."""
    import types

    from torch.distributed.tensor._api import _ToTorchTensor

    try:
        return _ToTorchTensor.backward(types.SimpleNamespace(), None) == (None, None)
    except Exception:  # noqa: BLE001 (the old backward reads the context first)
        return False


def from_local_takes_grad_placements() -> bool:
    """Whether ``DTensor.from_local`` takes ``grad_placements`` (torch 2.13 on;
    not 2.11): the compute view of a parameter on a ``dp_mesh_dims`` mesh
    needs it, so its gradient stays ``Partial`` over the data-parallel dims
    for the reduce-scatter ([Note: FSDP over DTensor parameters] in
    runtime/param.py)."""
    import inspect

    from torch.distributed.tensor import DTensor

    return "grad_placements" in inspect.signature(DTensor.from_local).parameters


# --- Dynamo -----------------------------------------------------------------

def aot_cache_takes_to_local() -> bool:
    """Whether AOTAutograd's cache stores a graph that calls ``DTensor.to_local``
    (every graph reading a sharded parameter). Torch 2.11's Dynamo traces the
    call as a function it makes on the fly (``prim_to_local``), which the cache
    refuses ("Unsupported call_function target"): the job bypasses it and
    only Inductor's FX-graph cache is hit. Later releases trace it without one.
    Tested by tests/test_compile_parity.py::test_a_second_job_hits_the_caches."""
    from torch._dynamo.variables.tensor import TensorVariable

    return not hasattr(TensorVariable, "method_to_local")


_PENDING = "_CompilationCallbackHandler__pending_callbacks_counter"


def saved_traces_load() -> bool:
    """Whether a trace of a sharded model that torch's caching precompile
    saved (``torch._dynamo.config.caching_precompile``, saved by
    ``torch.compiler.save_cache_artifacts()``) loads in the next job: [Note:
    Generated classes by reference] in runtime/generated.py. On 2.13.0 the
    load fails inside torch (unpickling an ``ImportSource`` installs a guard
    with no trace under way, and the retry raises "CompilePackage is already
    initialized" into the job), so there, as on 2.14 (not tried), the made
    classes pickle by name and no such trace is saved. Tried on 2.13.0 and
    2.15.0 (tests/test_precompile.py)."""
    return hasattr(torch._dynamo.config, "caching_precompile") and torch_release() >= (2, 15)


def caching_precompile_on() -> bool:
    """Whether torch's caching precompile is on now (``saved_traces_load``)."""
    return bool(getattr(torch._dynamo.config, "caching_precompile", False))


def end_callback_raised() -> None:
    """Called by a compile-end callback that is about to raise: undoes the
    pending-compile count that Dynamo's handler would have decremented after
    the callbacks had run (see the module's note)."""
    from torch._dynamo.callback import callback_handler

    if getattr(callback_handler, _PENDING, 0) > 0:
        setattr(callback_handler, _PENDING, getattr(callback_handler, _PENDING) - 1)


def never_a_frame(*functions: Callable[..., Any]) -> None:
    """Dynamo's frame evaluation runs these functions, and every frame they
    call, as Python; tracing still inlines them where a traced frame calls
    them. For code that is the eager runtime when Dynamo did not inline it
    ([Note: Hooks under Dynamo] in runtime/state.py)."""
    _run_as_python(functions, callees_too=True)


def not_a_frame_itself(*functions: Callable[..., Any]) -> None:
    """As ``never_a_frame``, but the frames these functions call are
    evaluated as any other (compiled under ``torch.compile``)."""
    _run_as_python(functions, callees_too=False)


def _run_as_python(functions: tuple[Callable[..., Any], ...], callees_too: bool) -> None:
    from torch._dynamo.eval_frame import set_code_exec_strategy
    from torch._dynamo.types import FrameAction, FrameExecStrategy

    callees = FrameAction.SKIP if callees_too else FrameAction.DEFAULT
    for fn in functions:
        set_code_exec_strategy(fn.__code__, FrameExecStrategy(FrameAction.SKIP, callees))


def post_accumulate_grad_hooks(tensor: torch.Tensor) -> list[Callable[[torch.Tensor], None]]:
    """The hooks ``tensor.register_post_accumulate_grad_hook`` registered, in
    order (autograd keeps them in an internal dict, None before the first)."""
    return list((getattr(tensor, "_post_accumulate_grad_hooks", None) or {}).values())


def outermost_traced_code(ctx: Any) -> Any:
    """The code object of the frame Dynamo compiles, from a ``comptime``
    context anywhere inside it (through the inlined calls' parents)."""
    tx = ctx._i_will_not_complain_if_bc_breaks_InstructionTranslator()
    while getattr(tx, "parent", None) is not None:
        tx = tx.parent
    return tx.f_code


def frame_callback() -> Any:
    """Dynamo's frame-evaluation callback of this thread (None outside ``torch.compile``)."""
    from torch._C._dynamo.eval_frame import get_eval_frame_callback

    return get_eval_frame_callback()


def restore_frame_callback(callback: Any) -> None:
    """Sets this thread's frame-evaluation callback back to ``callback``:
    a compile that raised leaves it unset for the rest of the compiled
    call (2.11 and 2.15 alike), so that a frame called again from Python
    would run uncompiled. The compiled call restores its own on return."""
    from torch._C._dynamo.eval_frame import set_eval_frame

    set_eval_frame(callback)



def skipped_frame_breaks(code: Any) -> list[str]:
    """Dynamo's messages for the graph breaks that made it skip ``code``'s
    frame, running it as Python (a break inside a ``for`` loop, which Dynamo
    cannot resume from): its ``unimplemented`` counter, whose message names
    such a frame "frame skipped: <name> (<file> line <first line>)" on
    2.11, 2.13 and 2.15 (tests/test_graph_breaks.py::test_a_break_inside_the_blocks_loop_says_so)."""
    from torch._dynamo.utils import counters

    tag = f"frame skipped: {code.co_name} ({code.co_filename} line {code.co_firstlineno})"
    return [msg for msg in counters["unimplemented"] if tag in msg]


# --- Inductor ---------------------------------------------------------------

def _sequence_of_post_grad_passes() -> bool:
    from torch._inductor import custom_graph_pass

    return hasattr(custom_graph_pass, "get_custom_graph_passes")


class _Chained:
    """Several post-grad passes as the one callable torch 2.11 accepts; made a
    ``CustomGraphPass`` subclass by ``_chained_type`` (lazily: importing
    Inductor's module is not free)."""

    def __init__(self, passes: tuple) -> None:
        self.passes = tuple(passes)

    def __call__(self, graph: Any) -> None:
        for p in self.passes:
            p(graph)

    def uuid(self) -> Optional[Any]:
        import hashlib

        from torch._inductor.custom_graph_pass import CustomGraphPass

        h = hashlib.sha256()
        for p in self.passes:
            u = p.uuid() if isinstance(p, CustomGraphPass) else None
            if not u:
                return None  # Inductor bypasses its cache, as for one such pass
            h.update(repr(u).encode())
        return h.digest()


@functools.lru_cache(1)
def _chained_type() -> type:
    from torch._inductor.custom_graph_pass import CustomGraphPass

    return type("ChainedGraphPass", (_Chained, CustomGraphPass), {})


def post_grad_passes(value: Any) -> tuple:
    """The passes in a value of ``torch._inductor.config.post_grad_custom_post_pass``."""
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(value)
    if isinstance(value, _Chained):
        return value.passes
    return (value,)


def post_grad_value(passes: tuple) -> Any:
    """What to set ``post_grad_custom_post_pass`` to so that ``passes`` run in order."""
    if not passes:
        return None
    if len(passes) == 1:
        return passes[0]
    if _sequence_of_post_grad_passes():
        return tuple(passes)
    return _chained_type()(passes)


def _has_simple_overlap() -> bool:
    from torch._inductor import config as inductor_config

    section = getattr(inductor_config, "aten_distributed_optimizations", None)
    return section is not None and hasattr(section, "enable_simple_overlap")


SIMPLE_OVERLAP: bool = _has_simple_overlap()


# --- AOTAutograd: rng states saved after opaque objects (see the note) -----

def _rng_states_before_opaque(fw_module: Any, bw_module: Any, is_opaque: Any) -> None:
    import operator

    from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state

    def opaque_run_before(seq: list, first: Any) -> int:
        """Where the run of opaque values just before ``first`` begins."""
        at = seq.index(first)
        while at > 0 and is_opaque(seq[at - 1]):
            at -= 1
        return at

    out = next(iter(fw_module.graph.find_nodes(op="output")))
    outs = list(out.args[0])
    states = [n for n in outs if isinstance(n, torch.fx.Node) and n.target is operator.getitem
              and isinstance(n.args[0], torch.fx.Node) and n.args[0].target is run_and_save_rng_state
              and n.args[1] == 0]
    if not states:
        return  # (none, or kept in generator states: graph-safe rng on CUDA)
    at = opaque_run_before(outs, states[0])
    if outs[at] is states[0]:
        return  # in place
    moved = set(states)
    out.args = (tuple(outs[:at] + states + [n for n in outs[at:] if n not in moved]), *out.args[1:])
    fw_module.recompile()

    inputs = list(bw_module.graph.find_nodes(op="placeholder"))
    bw_states = [p for p in inputs if any(u.target is run_with_rng_state and u.args[0] is p for u in p.users)]
    first = inputs[opaque_run_before(inputs, bw_states[0])]
    for p in bw_states:
        first.prepend(p)
    bw_module.recompile()


_RNG_FIX = "_compiled_fsdp_rng_states_before_opaque"


def fix_rng_state_order() -> Callable[[], None]:
    """Where the partitioner saves opaque objects (torch 2.12 on), wraps its
    ``functionalize_rng_ops`` so that the rng states it saves come before
    them (see the module's note); returns what puts the original back."""
    from torch._functorch import partitioners
    from torch._functorch._aot_autograd import graph_compile

    is_opaque = getattr(graph_compile, "is_opaque_node", None)
    original = getattr(partitioners, "functionalize_rng_ops", None)
    if is_opaque is None or original is None or getattr(original, _RNG_FIX, False):
        return lambda: None

    @functools.wraps(original)
    def functionalize_rng_ops(*args: Any, **kwargs: Any) -> Any:
        fw_module, bw_module = original(*args, **kwargs)
        _rng_states_before_opaque(fw_module, bw_module, is_opaque)
        return fw_module, bw_module

    setattr(functionalize_rng_ops, _RNG_FIX, True)
    partitioners.functionalize_rng_ops = functionalize_rng_ops

    def restore() -> None:
        partitioners.functionalize_rng_ops = original

    return restore


def torch_fsdp_state_class() -> type:
    """torch's FSDP2 state class. [Note: Seen as FSDP2's state]: the state
    ``fully_shard`` attaches derives from it, and only so that torch's helpers
    that filter the composable states by it (``_get_module_fsdp_state``, hence
    ``_get_managed_modules`` and the tools that walk composable states) treat a
    module sharded here as sharded; none of its methods or attributes is used
    (its ``__init__`` is not run). Private to torch; the same path in every
    supported release (2.11-2.15). Test: tests/test_fsdp2_api.py::
    test_torch_helpers_see_sharded_modules."""
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    return FSDPState


def fsdp2_has_reset_iter_state() -> bool:
    """Whether torch's own FSDP2 has ``FSDPModule.reset_iter_state`` (added in
    2.13): the tests compare ours with it where it exists."""
    from torch.distributed.fsdp import FSDPModule

    return hasattr(FSDPModule, "reset_iter_state")


def register_first_forward_pre_hook(module: torch.nn.Module, hook: Callable) -> Any:
    """``module.register_forward_pre_hook(hook, prepend=True,
    with_kwargs=True)``, with the hooks already there inserted again after
    ``hook`` instead of ``hook`` moved before them. Torch 2.11's Dynamo
    names a hook by its place in the dict's insertion order (``dict.keys``),
    which ``prepend``'s ``move_to_end`` leaves as it was: a user's pre-hook
    registered before ``fully_shard`` was taken for FSDP's, and the first
    compile raised "'function' object has no attribute '__func__'" (2.13 and
    2.15 follow the order the hooks run in). Either way FSDP's runs first.
    Tested by tests/test_region_variants.py::test_a_region_block_with_hooks_of_its_users."""
    handle = module.register_forward_pre_hook(hook, with_kwargs=True)
    hooks = module._forward_pre_hooks
    others = [(key, h) for key, h in hooks.items() if key != handle.id]
    for key, _ in others:
        del hooks[key]
    hooks.update(others)
    return handle


def register_composable_state(module: Any, state: Any) -> None:
    """Enter ``state`` in torch's map of composable-API states (the one
    ``torch.distributed._composable_state._get_module_state`` reads), so
    torch's composable tools see that ``module`` is managed. Private to torch;
    present in every supported release (2.11-2.15)."""
    from torch.distributed import _composable_state

    _composable_state._module_state_mapping[module] = weakref.ref(state)


def module_state(module: Any) -> Any:
    """The state entered for ``module`` in that map (by this project or by a
    torch composable API), or None (also once it was freed)."""
    from torch.distributed import _composable_state

    ref = _composable_state._module_state_mapping.get(module)
    return None if ref is None else ref()


def side_effects_allowed_under_checkpoint() -> bool:
    """Whether Dynamo traces a Python side effect inside an activation
    checkpoint without breaking the graph: ``torch._dynamo.config.
    skip_fwd_side_effects_in_bwd_under_checkpoint`` (torchtitan sets it; absent
    on a release that lacks it: False)."""
    import torch._dynamo.config as dynamo_config

    return bool(getattr(dynamo_config, "skip_fwd_side_effects_in_bwd_under_checkpoint", False))


def set_side_effects_under_checkpoint(value: bool) -> bool:
    """Set ``skip_fwd_side_effects_in_bwd_under_checkpoint`` as torchtitan's
    ``apply_compile`` does (for the benchmarks and tests that imitate it; the
    project never sets it). Returns whether this release has the flag."""
    import torch._dynamo.config as dynamo_config

    if not hasattr(dynamo_config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        return False
    dynamo_config.skip_fwd_side_effects_in_bwd_under_checkpoint = value
    return True


def torch_policy_classes() -> tuple[type, type, type]:
    """torch's FSDP2 ``MixedPrecisionPolicy``, ``OffloadPolicy`` and
    ``CPUOffloadPolicy``, which ``fully_shard`` takes in place of its own."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

    return MixedPrecisionPolicy, OffloadPolicy, CPUOffloadPolicy


def nested_compile_region(fn: Callable[..., Any], options: Any) -> Callable[..., Any]:
    """``torch.compiler.nested_compile_region`` with no cap on the variants
    Dynamo keeps of one region: 2.13 and 2.15 raise at the ninth (their
    ``max_reuse_entries``), where blocks of one class differ in shape (each
    is traced and compiled as its own variant then, as in one graph);
    2.11 has no cap."""
    region = torch.compiler.nested_compile_region
    if region_traces_reused():
        return region(fn, options=options, max_reuse_entries=2**31)
    return region(fn, options=options)


@functools.lru_cache(1)
def region_traces_reused() -> bool:
    """Whether Dynamo reuses a ``nested_compile_region``'s trace for a later
    call whose guards hold (2.13, 2.15: the variants ``max_reuse_entries``
    caps), rather than tracing every call and keeping one subgraph for equal
    graphs (2.11)."""
    return "max_reuse_entries" in inspect.signature(torch.compiler.nested_compile_region).parameters


def cudagraph_unsafe_tags() -> tuple:
    """``torch.Tag.cudagraph_unsafe`` where this torch has it: an op Inductor
    must never capture in a CUDA graph (a replay would skip its Python, as
    ``regather``'s choice between a prefetched gather and its own)."""
    tag = getattr(torch.Tag, "cudagraph_unsafe", None)
    return () if tag is None else (tag,)


@functools.lru_cache(1)
def spmd_types_package() -> Any:
    """The ``spmd_types`` package where this torch's FSDP2 translates its
    annotations on plain parameters into DTensor placements (torch 2.15 with
    the package installed), else None. Asked once: every hook asks it
    (``no_spmd_typecheck``)."""
    available = getattr(dist, "_is_spmd_types_available", None)
    if available is None or not available():
        return None
    import spmd_types

    return spmd_types


def no_spmd_typecheck() -> Any:
    """A context in which spmd_types' type checking is off (the runtime's own
    tensor work in its hooks, as FSDP2's ``_spmd_no_typecheck``); a no-op
    where this torch reads no annotations."""
    spmd = spmd_types_package()
    return contextlib.nullcontext() if spmd is None else spmd.no_typecheck()


def grads_in_reduce_dtype() -> bool:
    """Whether this torch's FSDP2 takes a gradient in its reduce dtype as autograd
    produced it (``Tensor.grad_dtype``, ``ctx.set_output_grad_dtype``: torch
    2.15) and, without ``reduce_dtype``, reduces in the parameter's own dtype;
    before, it rounded the gradient to ``param_dtype`` and reduced in that."""
    return hasattr(torch.autograd.function.FunctionCtx, "set_output_grad_dtype")


def attention_ops(names: tuple[str, ...]) -> frozenset:
    """The ``aten`` op packets of these names that this torch has (the fused
    attention ops: [Note: Attention's own rate] in passes/cost_model.py)."""
    return frozenset(getattr(torch.ops.aten, name) for name in names if hasattr(torch.ops.aten, name))
