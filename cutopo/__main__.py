"""``python -m cutopo ...``: the same program as the ``cutopo`` command."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
