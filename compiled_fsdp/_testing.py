"""Test-only switches that break the runtime on purpose, to prove the numerics
checker (and the tests) can fail. Never set in real training."""
from __future__ import annotations

import os

# The FQN of a fully sharded module ("" is the root) whose gradients the eager
# runtime then never reduce-scatters: its shards keep grad=None.
SKIP_GRAD_REDUCTION_ENV = "COMPILED_FSDP_TEST_SKIP_GRAD_REDUCTION"


def skips_grad_reduction(module_fqn: str) -> bool:
    return os.environ.get(SKIP_GRAD_REDUCTION_ENV) == module_fqn
