"""The core layer: what every other layer of compiled_fsdp may import, and
which imports nothing else of the package (see DESIGN.md, "Layering")."""
