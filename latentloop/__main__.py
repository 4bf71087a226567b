"""`python -m latentloop ...`: the same command line as the `latentloop` script."""

import sys

from .cli import main

sys.exit(main())
