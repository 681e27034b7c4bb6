"""What the CLI's commands share: finding the stack, connecting, printing."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass

from shared.bus.connect import Bus
from shared.fence.keys import DEFAULT_PARTITIONS
from shared.subjects import DEFAULT_PREFIX, Subjects

STACK_FILE = os.path.join(".vmfence", "stack.json")


class CliError(Exception):
    """A one-line message for the user; the command exits 2."""


@dataclass(frozen=True)
class Stack:
    nats_url: str
    apiserver_url: str | None = None
    kubeconfig: str | None = None
    prefix: str = DEFAULT_PREFIX
    partitions: int = DEFAULT_PARTITIONS


def load_stack(path: str = STACK_FILE) -> Stack | None:
    try:
        with open(path) as f:
            raw = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise CliError(f"cannot read {path}: {exc}") from None
    return Stack(
        nats_url=raw["nats_url"],
        apiserver_url=raw.get("apiserver_url"),
        kubeconfig=raw.get("kubeconfig"),
        prefix=raw.get("prefix", DEFAULT_PREFIX),
        partitions=int(raw.get("partitions", DEFAULT_PARTITIONS)),
    )


def resolve_nats(arg: str | None) -> tuple[str, Subjects]:
    """--nats, else $VMFENCE_NATS_URL, else the stack `vmfence up` recorded."""
    prefix = os.environ.get("VMFENCE_PREFIX", DEFAULT_PREFIX)
    partitions = int(os.environ.get("VMFENCE_PARTITIONS", DEFAULT_PARTITIONS))
    url = arg or os.environ.get("VMFENCE_NATS_URL")
    if url is None:
        stack = load_stack()
        if stack is None:
            raise CliError("no --nats given, VMFENCE_NATS_URL unset, and no local stack (.vmfence/stack.json)")
        return stack.nats_url, Subjects(stack.prefix, stack.partitions)
    return url, Subjects(prefix, partitions)


async def open_bus(arg: str | None, name: str) -> Bus:
    url, subjects = resolve_nats(arg)
    try:
        return await Bus.open(url.split(","), name=name, subjects=subjects, max_reconnect_attempts=2)
    except Exception as exc:
        raise CliError(f"cannot connect to NATS at {url}: {exc}") from None


def eprint(*parts: object) -> None:
    print(*parts, file=sys.stderr)
