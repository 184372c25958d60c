"""The ``kvpush`` command line: one subcommand per service or tool."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kvpush`` console script."""
    parser = argparse.ArgumentParser(prog="kvpush", description=__doc__)
    parser.add_subparsers(dest="command", required=True)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
