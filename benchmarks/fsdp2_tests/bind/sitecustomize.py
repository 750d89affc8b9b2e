"""Binds PyTorch's FSDP2 names to compiled_fsdp in every process of a test run
(the pytest process and the ranks it spawns), when ``COMPILED_FSDP_BIND`` is
``eager`` or ``compiled`` (``fsdp2_compiled`` wraps FSDP2's own ``fully_shard``
instead); does nothing otherwise. Put on ``PYTHONPATH`` by
``benchmarks/fsdp2_tests/run.py`` only: the project itself never patches torch.

``compiled`` also compiles every module ``fully_shard`` returns in place
(``module.compile(backend="aot_eager")``), as a user compiling each sharded
block would; ``fsdp2_compiled`` does the same to FSDP2's own modules (the
peer of ``compiled``: what compiling in place costs FSDP2 on this machine).
"""
import os

_MODE = os.environ.get("COMPILED_FSDP_BIND", "")

if os.environ.get("COMPILED_FSDP_GPU_TESTS_ON_CPU") == "1":
    # Tests marked for 2+ GPUs also run on a machine without one, on gloo, as
    # the ones marked ``allow_cpu`` do (the count then covers every test
    # FSDP2 itself passes on the CPU, in every mode alike).
    import torch.testing._internal.common_distributed as _cd

    _skip_if_lt_x_gpu = _cd.skip_if_lt_x_gpu

    def _allow_cpu(x, *, allow_cpu=False):  # noqa: ANN001, ANN202
        return _skip_if_lt_x_gpu(x, allow_cpu=True)

    _cd.skip_if_lt_x_gpu = _allow_cpu

    import torch

    if not torch.accelerator.is_available():
        # ``FSDPTest._run`` skips every multi-process test when fewer
        # accelerators than ranks are found, CPU or not; on a machine without
        # one, the ranks run on the CPU and gloo (``DEVICE_TYPE`` is "cpu").
        torch.accelerator.device_count = lambda: 1 << 10


def _compiling(shard):  # noqa: ANN001, ANN202
    """``shard``, then each module it returns compiled in place (``aot_eager``)."""
    import functools

    @functools.wraps(shard)
    def wrapped(module, *args, **kwargs):  # noqa: ANN001, ANN202
        out = shard(module, *args, **kwargs)
        for m in (out if isinstance(out, list) else [out]):
            m.compile(backend="aot_eager")
        return out

    return wrapped


if _MODE in ("eager", "compiled", "fsdp2_compiled"):
    import torch.distributed.fsdp as _fsdp
    import torch.distributed.fsdp._fully_shard as _fsdp_pkg
    import torch.distributed.fsdp._fully_shard._fully_shard as _fsdp_mod

    if _MODE == "fsdp2_compiled":  # (FSDP2 itself, compiled as ``compiled`` compiles ours: the peer)
        _names = {"fully_shard": _compiling(_fsdp.fully_shard)}
        _targets = (_fsdp, _fsdp_pkg)
    else:
        import compiled_fsdp as _ours

        _names = {
            "fully_shard": _compiling(_ours.fully_shard) if _MODE == "compiled" else _ours.fully_shard,
            "FSDPModule": _ours.FSDPModule,
            "UnshardHandle": _ours.UnshardHandle,
            "register_fsdp_forward_method": _ours.register_fsdp_forward_method,
        }
        _targets = (_fsdp, _fsdp_pkg, _fsdp_mod)
    for _target in _targets:
        for _name, _value in _names.items():
            if hasattr(_target, _name):
                setattr(_target, _name, _value)
