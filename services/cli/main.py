"""The `vmfence` command: services, the operator's commands, and whatever command groups installed
packages register (the test bench's demo, up, chaos and bench)."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import sys
from collections.abc import Callable
from importlib.metadata import entry_points

from services.cli import console, decisions, replay, status, verify, vnc
from services.cli.common import CliError, eprint
from shared import heap
from shared.tasks import run_main

SERVICES: dict[str, str] = {
    "reconciler": "services.reconciler.service",
    "agent": "services.agent.service",
    "watcher": "services.watcher.service",
    "apiserver": "services.apiserver.server",
}
COMMAND_GROUP = "vmfence.commands"  # entry points: a callable add_parsers(subparsers)


def _service_main(module: str) -> Callable[[list[str]], int]:
    def run(argv: list[str]) -> int:
        mod = importlib.import_module(module)
        heap.settle()  # once imported: see shared.heap
        return int(mod.main(argv))

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vmfence", description=__doc__)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SERVICES:
        sub.add_parser(name, help=f"run the {name} service (flags: vmfence {name} --help)", add_help=False)
    replay.add_parsers(sub)
    decisions.add_parsers(sub)
    status.add_parser(sub)
    verify.add_parser(sub)
    vnc.add_parser(sub)
    console.add_parser(sub)
    for ep in sorted(entry_points(group=COMMAND_GROUP), key=lambda e: e.name):
        try:
            ep.load()(sub)
        except Exception as exc:  # a broken plugin must not take the operator's commands with it
            eprint(f"vmfence: the {ep.name} commands are unavailable ({type(exc).__name__}: {exc})")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SERVICES:
        return _service_main(SERVICES[argv[0]])(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "run", None):
        parser.print_help()
        return 2
    try:
        result = args.run(args)
        if asyncio.iscoroutine(result):
            result = run_main(result)
        return int(result)
    except CliError as exc:
        eprint(f"vmfence {args.command}: {exc}")
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
