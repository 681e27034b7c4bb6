"""What the CLI's commands share: finding the stack, connecting, printing."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from shared.bus.connect import Bus, NatsAuthError
from shared.config import BusSettings, ConfigError, NatsSettings, load
from shared.fence.keys import DEFAULT_PARTITIONS
from shared.subjects import DEFAULT_PREFIX

if TYPE_CHECKING:
    from kubernetes_asyncio.client import ApiClient

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


@dataclass(frozen=True)
class OperatorConfig(NatsSettings, BusSettings):
    """What an operator command needs of NATS: the shared settings every service reads, from the
    same ``VMFENCE_*`` variables (so ``VMFENCE_NATS_USER=audit`` works for every command)."""

    PROG: ClassVar[str] = "vmfence"


def resolve_nats(arg: str | None, env: Mapping[str, str] | None = None) -> OperatorConfig:
    """--nats, else $VMFENCE_NATS_URL, else the stack `vmfence up` recorded; credentials, TLS,
    prefix and partitions from the environment (the stack's prefix and partitions with its URL)."""
    env = os.environ if env is None else env
    argv = ["--nats-url", arg] if arg else []
    if not arg and not env.get("VMFENCE_NATS_URL", "").strip():
        stack = load_stack()
        if stack is None:
            raise CliError("no --nats given, VMFENCE_NATS_URL unset, and no local stack (.vmfence/stack.json)")
        argv = ["--nats-url", stack.nats_url, "--prefix", stack.prefix, "--partitions", str(stack.partitions)]
    try:
        return load(OperatorConfig, argv, env)
    except ConfigError as exc:
        raise CliError(str(exc)) from None


async def open_bus(arg: str | None, name: str) -> Bus:
    cfg = resolve_nats(arg)
    try:
        return await Bus.open(cfg.nats_url, name=name, subjects=cfg.subjects, max_reconnect_attempts=2,
                              auth=cfg.nats_auth)
    except NatsAuthError as exc:
        raise CliError(str(exc)) from None
    except Exception as exc:
        raise CliError(f"cannot connect to NATS at {cfg.nats_display}: {exc}") from None


def eprint(*parts: object) -> None:
    print(*parts, file=sys.stderr)


def pod_key(arg: str) -> tuple[str, str]:
    """``NAMESPACE/NAME`` as (namespace, name), or CliError in one line."""
    ns, sep, name = arg.partition("/")
    if not sep or not ns or not name or "/" in name:
        raise CliError(f"{arg!r} is not NAMESPACE/NAME")
    return ns, name


async def kube_api(kubeconfig: str) -> ApiClient:
    """The API client of a kubeconfig file (the services' constructor), or CliError in one line."""
    from kubernetes_asyncio import client, config

    from shared.kubeclient import api_client

    cfg = client.Configuration()
    try:
        await config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    except Exception as exc:
        raise CliError(f"cannot load the kubeconfig {kubeconfig}: {exc}") from None
    return api_client(cfg)
