"""``python -m quire.kernels build|status``: build the C++ CPU kernels ahead of time, or say which path runs.

``build`` builds the kernels for this machine (or loads the existing build), trying again after a remembered
failure; it exits 0 when they load and 1, with the error, when they do not. ``status`` prints the line of
``cpu_extension.describe()`` and never compiles.
"""

from __future__ import annotations

import argparse
import logging
import sys

from quire.kernels.build_guard import KernelBuildError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m quire.kernels", description="Quire's C++ CPU kernels.")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("build", help="build them for this machine now (minutes), or load the existing build; "
                                      "tries again after a failed build")
    commands.add_parser("status", help="print which CPU kernel path runs here and why (never builds)")
    arguments = parser.parse_args(argv)
    # the build's progress lines (warnings of quire.kernels) on stderr, without logger names
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from quire.kernels import cpu_extension  # imports torch: after parsing, so --help stays fast

    if arguments.command == "status":
        print(cpu_extension.describe())
        return 0
    try:
        cpu_extension.build()
    except KernelBuildError as error:
        print(f"Quire's C++ CPU kernels could not be built: {error}", file=sys.stderr)
        if error.__cause__ is not None:
            print(error.__cause__, file=sys.stderr)
        return 1
    print(cpu_extension.describe())
    return 0


if __name__ == "__main__":
    sys.exit(main())
