import sys

from .isa import IsaError, apply

try:   # before torch is imported: the path holds every library the engine uses
    apply()
except IsaError as e:
    print(f"[probity engine] error: {e}", file=sys.stderr, flush=True)
    sys.exit(3)

from .engine import main  # noqa: E402

main()
