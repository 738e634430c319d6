"""`python -m disttrain ...` is the `disttrain` command."""

import sys

from disttrain.cli import main

sys.exit(main())
