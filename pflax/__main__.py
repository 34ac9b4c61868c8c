"""`python -m pflax`: the same as `pflax-run`."""

import sys

from pflax._src.cli.main import main

if __name__ == "__main__":
  sys.exit(main())
