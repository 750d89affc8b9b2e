"""Compiled-vs-eager numerics checker.

    python -m compiled_fsdp.check --world-size 2 --steps 5 [--model module:factory]

launches ``--world-size`` gloo ranks itself and trains, from the same seed and
on the same batches, the single-process unsharded reference and each variant:
the eager hook runtime (``eager``), ``torch.compile(backend="aot_eager")`` and
``torch.compile()`` with Inductor (``inductor``) on the root; on request also
each sharded module but the root compiled on its own, torchtitan's pattern
(``blocks`` with ``aot_eager``, ``blocks_inductor``; see [Note: Blocks compiled
on their own]). It prints a table per step and, on a mismatch, the first fully
sharded module whose gradient diverges. Exit status 0 within tolerance, 1
outside, 2 when a rank failed or hung.

[Note: Model protocol]
``--model module:factory`` (default: the tiny GPT of
``compiled_fsdp/tools/models.py``, which ``examples.gpt`` re-exports):
``factory()`` returns the ``nn.Module`` (called after
``torch.manual_seed(0)``, once per variant; it must build the same weights
every time). Three optional hooks are looked up on the factory object, then
in its module, then fall back to the GPT ones:

* ``make_batch(model, batch_size, seed) -> tuple``: the model's positional
  inputs (default: ``(models.batch(model.cfg, batch_size, seed),)``);
* ``loss_fn(output, *inputs) -> Tensor``: a scalar, the *mean* over the batch
  (default: ``models.loss_fn``, next-token cross entropy);
* ``shard(model)``: applies ``fully_shard`` (default: each of
  ``model.layers``, then the root).

[Note: Default tolerances]
Bitwise (0.0) wherever the math allows it, measured on the tiny GPT:

* ``aot_eager`` (and ``blocks``) against the eager runtime: always bitwise.
  Both use the same bucket layout (see [Note: Shard layout]) and aot_eager runs
  the same aten ops.
* eager and ``aot_eager`` against the reference, every rank fed the same batch
  (the default): bitwise on 1 or 2 ranks, as (g + g) / 2 == g exactly. On 3+
  ranks g + g + g rounds: 1-ulp gradients, parameters within 7e-7 after 3
  AdamW steps; default 1e-5 (AdamW divides by sqrt(v): a 1-ulp gradient
  difference can move a parameter by up to ~lr per step).
* ``inductor`` (and ``blocks_inductor``) against the reference: Inductor fuses and reorders float math;
  1e-5 after 3 AdamW steps at lr 1e-3 was measured; default ``--inductor-atol``
  2e-5 for the default 5 steps.
* ``--per-rank-data``: each rank gets its own batch and the reference trains on
  their concatenation; the mean of per-rank means equals the mean of the
  concatenated batch only in exact math, so nothing is bitwise: default 1e-5
  (``aot_eager`` against eager stays bitwise).

Tolerances bound the max absolute difference of the parameters after each
step and of every gradient before it (the loss is only printed). Override with
``--atol`` (eager and aot_eager vs the reference), ``--inductor-atol`` and
``--compiled-vs-eager-atol``.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Optional

from compiled_fsdp.tools.check_worker import CheckConfig, run_rank
from compiled_fsdp.tools.launch import run_distributed

__all__ = ["main", "tolerances", "verdict"]

VARIANTS = ("eager", "aot_eager", "inductor", "blocks", "blocks_inductor")
DEFAULT_VARIANTS = ("eager", "aot_eager", "inductor")
# Variants that must match the eager runtime bitwise (--compiled-vs-eager-atol).
_VS_EAGER = ("aot_eager", "blocks")


def tolerances(args: argparse.Namespace) -> dict[str, float]:
    """Per check: each variant's (vs the reference), and 'aot_eager_vs_eager'."""
    exact = args.world_size <= 2 and not args.per_rank_data
    base = args.atol if args.atol is not None else (0.0 if exact else 1e-5)
    inductor = args.inductor_atol if args.inductor_atol is not None else max(base, 2e-5)
    return {
        "eager": base,
        "aot_eager": base,
        "inductor": inductor,
        "blocks": base,
        "blocks_inductor": inductor,
        "aot_eager_vs_eager": args.compiled_vs_eager_atol,
    }


def launch(cfg: CheckConfig, world: int, timeout: float) -> dict[str, Any]:
    """Rank 0's result of ``run_rank`` on ``world`` gloo ranks; a rank that raises
    or is still running after ``timeout`` seconds raises here (no hang)."""
    return run_distributed(run_rank, world, cfg, timeout=timeout)[0]


def _fmt(x: float) -> str:
    return "0" if x == 0 else f"{x:.3e}"


def verdict(results: dict[str, Any], tol: dict[str, float], variants: list[str]) -> list[str]:
    """Prints the table; returns the failures (empty: within tolerance)."""
    failures: list[str] = []
    located: set[str] = set()  # variants whose first mismatch was already explained
    ref = results["reference"]
    for step, r in enumerate(ref):
        print(f"\nstep {step}")
        print(f"  {'variant':<15} {'loss':>12} {'grad norm':>12} {'max|dparam|':>12} {'max rel':>10} "
              f"{'max|dgrad|':>11} {'tol':>8}  ok")
        print(f"  {'reference':<15} {r['loss']:>12.7f} {r['grad_norm']:>12.7f}")
        for v in variants:
            m = results[v][step]
            dgrad = max(m["module_grad"].values(), default=0.0)
            worst = max(m["param_abs"], dgrad)
            ok = worst <= tol[v]
            extra = ""
            if v in _VS_EAGER and "eager" in variants:
                vs_ok = m["vs_baseline"] <= tol["aot_eager_vs_eager"]
                extra = f"  vs eager: {_fmt(m['vs_baseline'])} {'ok' if vs_ok else 'MISMATCH'}"
                if not vs_ok:
                    failures.append(f"step {step}: {v} differs from the eager runtime by "
                                    f"{_fmt(m['vs_baseline'])} (> {tol['aot_eager_vs_eager']:g})")
            print(f"  {v:<15} {m['loss']:>12.7f} {m['grad_norm']:>12.7f} {_fmt(m['param_abs']):>12} "
                  f"{_fmt(m['param_rel']):>10} {_fmt(dgrad):>11} {tol[v]:>8.0e}  "
                  f"{'ok' if ok else 'MISMATCH'}{extra}")
            if not ok and v in located:
                failures.append(f"step {step}: {v} still differs ({_fmt(worst)})")
            elif not ok:
                located.add(v)
                bad = [(mod, d) for mod, d in m["module_grad"].items() if d > tol[v]]
                where = (f"first module whose gradient diverges: {bad[0][0] or '<root>'} "
                         f"(max |dgrad| {_fmt(bad[0][1])}); all: "
                         + ", ".join(f"{mod or '<root>'}={_fmt(d)}" for mod, d in bad)
                         if bad else "gradients within tolerance: the optimizer step diverges")
                failures.append(f"step {step}: {v} differs from the reference by {_fmt(worst)} "
                                f"(> {tol[v]:g}); {where}")
    return failures


def _parse(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m compiled_fsdp.check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="compiled_fsdp.tools.models:tiny",
                   help="module:factory (default: the package's tiny GPT; examples.gpt:tiny is the same)")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help=f"comma-separated subset of {VARIANTS}")
    p.add_argument("--batch-size", type=int, default=2, help="per rank")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--per-rank-data", action="store_true", help="each rank its own batch (not bitwise)")
    p.add_argument("--atol", type=float, default=None, help="eager/aot_eager/blocks vs reference")
    p.add_argument("--inductor-atol", type=float, default=None)
    p.add_argument("--compiled-vs-eager-atol", type=float, default=0.0,
                   help="aot_eager/blocks vs eager runtime")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before the ranks count as hung")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = _parse(argv)
    variants = [v for v in VARIANTS if v in args.variants.split(",")]  # eager first
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown or not variants:
        print(f"unknown variants {sorted(unknown)}; choose from {VARIANTS}", file=sys.stderr)
        return 2
    cfg = CheckConfig(args.model, tuple(variants), args.steps, args.batch_size, args.lr, args.per_rank_data)
    tol = tolerances(args)
    data = "per-rank batches" if args.per_rank_data else "the same batch on every rank"
    print(f"compiled_fsdp numerics check: {args.model} on {args.world_size} gloo ranks, {args.steps} AdamW "
          f"steps (lr {args.lr:g}), {data}; variants {', '.join(variants)} vs the single-process reference")
    try:
        results = launch(cfg, args.world_size, args.timeout)
    except (RuntimeError, TimeoutError) as e:
        print(f"FAILED to run:\n{e}", file=sys.stderr)
        return 2
    failures = verdict(results, tol, variants)
    if failures:
        print("\nMISMATCH:\n  " + "\n  ".join(failures))
        return 1
    print("\nOK: every variant within tolerance")
    return 0


if __name__ == "__main__":
    sys.exit(main())
