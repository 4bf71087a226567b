"""`python -m latentloop.cli ...`: the same command line as `latentloop ...`."""

import sys

from . import main

sys.exit(main())
