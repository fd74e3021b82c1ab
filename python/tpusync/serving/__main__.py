"""Alias: `python -m tpusync.serving` runs `python -m tpusync.engines.reference`."""
import sys

from tpusync.engines.reference.__main__ import main

if __name__ == "__main__":
    sys.exit(main())
