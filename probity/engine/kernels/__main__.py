"""`python -m probity.engine.kernels`: build the kernel library now (make setup does)."""
import sys

from . import lib, library_path, why_not

print(f"probity kernels: {library_path() if lib() is not None else 'not used: ' + str(why_not())}", file=sys.stderr)
