"""Kiln: compile a PyTorch model's whole training step. Commands: demo, explain, bench, adopt."""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kiln", description=__doc__)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    from kiln import demo
    demo.register(sub)
    try:
        from kiln.bench import cli as bench_cli
    except ImportError:  # pragma: no cover - the bench package is optional at import time
        bench_cli = None
    if bench_cli is not None:
        bench_cli.register(sub)
    from kiln.adopt import cli as adopt_cli
    adopt_cli.register(sub)

    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
