"""``python -m meshplan ...``: the same command line as the ``meshplan`` console script."""

import sys

from meshplan.cli import main

if __name__ == "__main__":
    sys.exit(main())
