"""`python -m assay ...`: the `assay` command, for environments whose console scripts are not on the PATH."""

import sys

from assay.cli import main

if __name__ == "__main__":
    sys.exit(main())
