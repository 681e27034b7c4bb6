"""`vmfence demo`, `up`, `status` and `bench` (filled in as the stack grows)."""

from __future__ import annotations

import argparse


def add_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from services.cli import bench

    bench.add_parsers(sub)
