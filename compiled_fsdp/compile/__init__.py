"""The compile layer: what ``torch.compile`` of a fully sharded model needs
from the runtime. It imports the core and the runtime, and the passes only
while a graph is being compiled (DESIGN.md, "Layering")."""
