"""The tests' multi-process harness is the package's own launcher."""
from compiled_fsdp.tools.launch import DEFAULT_TIMEOUT_S, run_distributed

__all__ = ["DEFAULT_TIMEOUT_S", "run_distributed"]
