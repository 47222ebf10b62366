"""`python -m modelfs.demo DIR [--size …] [--json]`."""

import sys

from modelfs.demo.cli import main

sys.exit(main())
