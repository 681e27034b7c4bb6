"""The few ``ip`` (iproute2) operations the pod network needs, each bounded: interfaces, addresses,
taps. Every interface vmfence creates carries the alias ``vmfence:<bridge>``; only such an
interface is ever changed or deleted (never one vmfence did not create)."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json

from .base import NetAttach, RuntimeFailure

IP_TIMEOUT_S = 10.0  # one `ip` command
ALIAS_PREFIX = "vmfence:"


class NetworkError(RuntimeFailure):
    """The host's network cannot be set up as configured (the message says why)."""


async def run_ip(*args: str, check: bool = True) -> str:
    """One ``ip`` command (bounded); its stdout. A failure raises NetworkError with its stderr."""
    try:
        proc = await asyncio.create_subprocess_exec(
            "ip", *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    except FileNotFoundError:
        raise NetworkError("the `ip` command (iproute2) is not installed: bridge networking needs it and the "
                           "right to make interfaces (root or CAP_NET_ADMIN); or run with --network user") from None
    try:
        out, err = await asyncio.wait_for(proc.communicate(), IP_TIMEOUT_S)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise NetworkError(f"ip {' '.join(args)}: no answer within {IP_TIMEOUT_S:g}s") from None
    if check and proc.returncode != 0:
        raise NetworkError(f"ip {' '.join(args)}: {err.decode(errors='replace').strip()}")
    return out.decode()


async def links() -> list[dict[str, object]]:
    """Every interface of this network namespace (``ip -j -d link``)."""
    raw = await run_ip("-j", "-d", "link", "show")
    data = json.loads(raw or "[]")
    return data if isinstance(data, list) else []


async def link(name: str) -> dict[str, object] | None:
    for item in await links():
        if item.get("ifname") == name:
            return item
    return None


async def used_subnets() -> dict[str, list[ipaddress.IPv4Network]]:
    """The IPv4 subnets configured on this machine's interfaces, by interface."""
    data = json.loads(await run_ip("-j", "-4", "addr", "show") or "[]")
    out: dict[str, list[ipaddress.IPv4Network]] = {}
    for item in data:
        for a in item.get("addr_info", []):
            with contextlib.suppress(ValueError, KeyError):
                out.setdefault(str(item["ifname"]), []).append(
                    ipaddress.IPv4Network(f"{a['local']}/{a['prefixlen']}", strict=False))
    return out


def owned(item: dict[str, object], bridge: str) -> bool:
    return item.get("ifalias") == ALIAS_PREFIX + bridge


async def ensure_tap(att: NetAttach) -> None:
    """The VM's tap, on its bridge and up; one with our alias is reused, any other interface of
    that name is refused (never taken over)."""
    if not att.tap:
        return
    cur = await link(att.tap)
    if cur is not None and not owned(cur, att.bridge):
        raise NetworkError(f"interface {att.tap} exists and was not created by this agent")
    if cur is None:
        await run_ip("tuntap", "add", "dev", att.tap, "mode", "tap")
        await run_ip("link", "set", "dev", att.tap, "alias", ALIAS_PREFIX + att.bridge)
    await run_ip("link", "set", "dev", att.tap, "master", att.bridge)
    await run_ip("link", "set", "dev", att.tap, "up")


async def delete_link(name: str, bridge: str) -> bool:
    """Delete ``name`` if this agent created it (its alias says so); False when absent or not ours."""
    cur = await link(name)
    if cur is None or not owned(cur, bridge):
        return False
    await run_ip("link", "del", "dev", name, check=False)
    return True


async def delete_tap(att: NetAttach | None) -> None:
    if att is not None and att.tap:
        await delete_link(att.tap, att.bridge)
