"""The runtime layer: ``fully_shard``, per-module state and hooks, the
parameter group, one parameter's lifecycle and the eager collectives. It
imports ``compiled_fsdp.core`` and ``compiled_fsdp.config`` only (DESIGN.md,
"Layering")."""
