"""`python -m specpilot ...`: the same command line as the `specpilot` script."""

import sys

from specpilot.cli import main

sys.exit(main())
