"""Tools on top of every layer: graph dumps, ``explain``, the numerics checker
and its launcher. No layer imports them (DESIGN.md, "Layering")."""
