"""``python -m pipeloom`` (and ``torchrun -m pipeloom``) runs the command line."""

import sys

from .cli import main

sys.exit(main())
