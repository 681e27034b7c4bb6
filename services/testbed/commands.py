"""The test bench's commands (demo, up, chaos, bench), registered with the ``vmfence`` entry point
through the ``vmfence.commands`` entry-point group declared in pyproject.toml."""

from __future__ import annotations

import argparse

from services.testbed import demo
from services.testbed.bench import command as bench
from services.testbed.chaos import command as chaos


def add_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    demo.add_parsers(sub)
    chaos.add_parsers(sub)
    bench.add_parsers(sub)
