"""Kiln: compile a PyTorch model's whole training step. Commands: demo, explain, bench, adopt."""
from __future__ import annotations

import argparse
import importlib
import sys

# command -> the module whose register(subparsers) adds it. Only the chosen command's module is
# imported: `kiln bench` loads torch and the model zoo, `kiln adopt` needs neither and starts fast.
COMMANDS = {"demo": "kiln.demo", "explain": "kiln.demo", "bench": "kiln.bench.cli", "adopt": "kiln.adopt.cli"}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="kiln", description=__doc__)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = [argv[0]] if argv and argv[0] in COMMANDS else list(COMMANDS)
    for name in dict.fromkeys(COMMANDS[c] for c in chosen):
        try:
            module = importlib.import_module(name)
        except ImportError:  # pragma: no cover - the bench package is optional at import time
            if name != COMMANDS["bench"]:
                raise
            continue
        module.register(sub)

    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
