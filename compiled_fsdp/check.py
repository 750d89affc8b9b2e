"""``python -m compiled_fsdp.check``: the numerics checker (compiled_fsdp/tools/check.py)."""
import sys

from compiled_fsdp.tools.check import main

if __name__ == "__main__":
    sys.exit(main())
