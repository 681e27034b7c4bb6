"""The `vmfence` command: services, stacks, audits and benchmarks behind one entry point."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable

from services.cli.common import CliError, eprint

SERVICES: dict[str, str] = {
    "reconciler": "services.reconciler.service",
    "agent": "services.agent.service",
    "watcher": "services.watcher.service",
    "apiserver": "services.apiserver.server",
}


def _service_main(module: str) -> Callable[[list[str]], int]:
    def run(argv: list[str]) -> int:
        import importlib

        mod = importlib.import_module(module)
        return int(mod.main(argv))

    return run


def build_parser() -> argparse.ArgumentParser:
    from services.cli import logcmds, stackcmds

    parser = argparse.ArgumentParser(prog="vmfence", description=__doc__)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SERVICES:
        sub.add_parser(name, help=f"run the {name} service (flags: vmfence {name} --help)", add_help=False)
    logcmds.add_parsers(sub)
    stackcmds.add_parsers(sub)
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
            result = _run_async(result)
        return int(result)
    except CliError as exc:
        eprint(f"vmfence {args.command}: {exc}")
        return 2
    except KeyboardInterrupt:
        return 130


def _run_async(coro):  # type: ignore[no-untyped-def]
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


if __name__ == "__main__":
    raise SystemExit(main())
