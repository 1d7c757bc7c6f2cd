"""Entry point: `python -m mtp_fsm.bench`."""

import sys

from .run import main

sys.exit(main())
