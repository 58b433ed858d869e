"""Moved to `batchyard bench soak` (benchmark/soak.py); this runs it with the same options."""
import sys

from benchmark.cli import main

sys.exit(main(["soak", *sys.argv[1:]]))
