"""``python -m exportlm``: the same entry point as the ``exportlm`` console script."""

import sys

from exportlm.cli import main

if __name__ == "__main__":
    sys.exit(main())
