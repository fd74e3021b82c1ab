"""What every tpusync command line does alike.

- `--help` prints and exits, before any work;
- input is checked while the arguments are parsed (`positive`), before any work starts;
- an error is one line, `PROG: error: MESSAGE`, exit status 1; `--debug` (or TPUSYNC_DEBUG=1)
  shows the traceback instead.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from tpusync import errors

# What a command reports as one line: tpusync's own errors and those of the system and of the
# input (a file that is not there, a value that does not parse). Anything else is a bug: its
# traceback is shown.
EXPECTED: tuple[type[BaseException], ...] = (errors.TpuSyncError, OSError, ValueError, RuntimeError)


def add_debug(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")


def positive(kind: Callable[[str], float] = float) -> Callable[[str], float]:
    """An argparse type: a number above zero (refused with argparse's one-line usage error)."""
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be above 0, not {text}")
        return value
    parse.__name__ = getattr(kind, "__name__", "number")  # argparse names the type in its messages
    return parse


def run(main: Callable[[list[str]], int], prog: str, argv: Sequence[str] | None = None) -> int:
    """main(argv)'s exit status, its expected errors printed as one line."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args or os.environ.get("TPUSYNC_DEBUG") == "1"
    try:
        return main(args)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except EXPECTED as e:
        if debug:
            raise
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
