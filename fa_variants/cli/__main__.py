"""``python -m fa_variants.cli``: the ``fa-variants`` command without installing it."""
import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
