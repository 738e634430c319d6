"""`python -m disttrain.cluster up|down|list|show|run ...`: the same as `disttrain cluster ...`."""

import sys

from disttrain.cli import main

if __name__ == "__main__":
    sys.exit(main(["cluster", *sys.argv[1:]]))
