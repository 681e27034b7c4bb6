"""Registration of the stack-level commands: demo, up, status, bench."""

from __future__ import annotations

import argparse


def add_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from services.cli import bench, status

    bench.add_parsers(sub)
    status.add_parser(sub)
    __import__("services.cli.chaos_procs", fromlist=["add_parsers"]).add_parsers(sub)  # vmfence chaos
    try:
        from services.cli import demo
    except ImportError:  # pragma: no cover - during development only
        return
    demo.add_parsers(sub)
