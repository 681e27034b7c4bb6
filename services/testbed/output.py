"""How the test bench's commands print a result: one JSON object, or indented JSON for people."""

from __future__ import annotations

import json
import sys


def emit(result: dict[str, object], as_json: bool) -> None:
    if as_json:
        sys.stdout.write(json.dumps(result) + "\n")
    else:
        for k, v in result.items():
            print(f"{k:>28}: {v}")
