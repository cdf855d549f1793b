"""``python -m attnkit`` (and ``torchrun -m attnkit``) runs the command line."""

import sys

from attnkit.cli import main

sys.exit(main())
