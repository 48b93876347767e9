"""The `strata` command's entry point: importing the CLI loads torch, which takes seconds; a
Ctrl-C in that time ends the command with one line instead of an import traceback."""

from __future__ import annotations

import sys


def main() -> int:
    try:
        from strata.cli import main as cli_main
    except KeyboardInterrupt:
        print("strata: interrupted", file=sys.stderr)
        return 130
    return cli_main()
