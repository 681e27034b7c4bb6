"""Pod networking on one agent host: a Linux bridge, an address pool, a tap per VM.

The shape (issue 12 §1, DESIGN rule 9):

- **The pool.** Each agent host has one IPv4 subnet (a /24 by default). Its first address is the
  gateway, on the host side of the bridge; every other address but the broadcast is a VM's. The
  subnet is ``--pod-cidr`` when given; otherwise the agent *leases* one /24 out of ``--pod-cidr-pool``
  (default 10.240.0.0/16): starting at a slot derived from the host name, the first /24 that no other
  agent on this machine holds (an ``flock`` on ``<lease dir>/<cidr>.lock``, held while the agent runs,
  released by the kernel when it dies) and that no interface on this machine already uses. The choice
  is written to ``<data-dir>/network.json`` and taken again at every restart (the VMs' addresses are
  in it). Hosts of one compose stack live in separate network namespaces and do not see each other's
  leases: there each agent gets an explicit ``--pod-cidr``.
- **The address.** One per VM, a reservation of kind ``ip`` owned by ``(vm_id, uid, epoch)`` in the
  agent's ledger: taken before the VM starts (intent before effect), released only when the VM is
  buried (removed, or lost: the runtime no longer runs it), never handed to anyone while it is held.
  A hibernated VM keeps its address with its snapshot (the guest's RAM has it configured) and the
  wake that restores that snapshot takes it over; the address is therefore the pod's across a
  hibernate/wake. The MAC is derived from the address, so a reused address never meets a stale ARP
  entry on the host.
- **The bridge and taps.** ``vmfbr<hash of the data dir>`` (unique per agent, 15 characters at most),
  tap ``vmt<hash of bridge and vm_id>``. Every interface the agent creates carries the alias
  ``vmfence:<bridge>``; the agent deletes an interface only when it carries that alias, so it never
  touches one it did not create. Taps outlive the agent process (VMs keep running across an agent
  restart); ``cleanup_on_stop`` stacks remove them with the VMs, and then the bridge.
- **The guest.** The project's guest image reads ``vmfence.ip=ADDR/PREFIX vmfence.gw=GATEWAY`` from
  its kernel command line (scripts/build-guest-image.sh). Other images get the NIC and the address in
  their status but no DHCP server: they must configure it themselves.
- **Other modes.** ``--network user`` keeps QEMU user-mode networking (no bridge, no address: the
  VM's status reports none instead of QEMU's 10.0.2.15, the same inside every guest); ``--network
  none`` gives VMs no NIC. The ``sim`` runtime allocates from the pool too (no bridge, no taps), by
  a /16 each out of 127.128.0.0/9: its VMs live in the agent's process, and whatever connects to their
  addresses (probes) stays on loopback instead of leaving by the default route.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import ipaddress
import logging
import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from services.agent.runtime.base import NetAttach, RuntimeFailure
from services.agent.runtime.netlink import (
    ALIAS_PREFIX,
    NetworkError,
    delete_link,
    delete_tap,
    ensure_tap,
    link,
    links,
    owned,
    run_ip,
    used_subnets,
)

log = logging.getLogger("vmfence.agent.network")

NetworkMode = Literal["bridge", "user", "none"]
NETWORK_MODES: tuple[NetworkMode, ...] = ("bridge", "user", "none")

DEFAULT_POD_CIDR_POOL = "10.240.0.0/16"
# the sim's VMs live in the agent's process: their addresses are loopback ones (127/8 is all local on
# Linux), so whatever probes or connects to them stays on this machine
SIM_POD_CIDR_POOL = "127.128.0.0/9"
SIM_HOST_PREFIX = 16  # a sim host runs thousands of VMs in the scale benches: 65 533 addresses each
HOST_PREFIX = 24  # the /24 an agent leases out of the pool
IFNAMSIZ = 15
NETWORK_FILE = "network.json"
LEASE_DIR_ENV = "VMFENCE_NET_LEASE_DIR"  # tests only: where the machine-wide pool leases live
ADDRESS_KIND = "ip"  # the ledger's reservation kind


class PoolExhausted(RuntimeFailure):
    """Every address of the pool is held by a VM's fence."""


def fnv1a(text: str) -> int:
    h = 0x811C9DC5
    for b in text.encode():
        h = ((h ^ b) * 0x01000193) & 0xFFFFFFFF
    return h


def _digest(*parts: str, n: int) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:n]


def bridge_name(data_dir: str) -> str:
    """The agent's bridge: unique per data dir (one agent per data dir), at most 15 characters."""
    return "vmfbr" + _digest(os.path.abspath(data_dir), n=IFNAMSIZ - 5)


def tap_name(bridge: str, vm_id: str) -> str:
    return "vmt" + _digest(bridge, vm_id, n=IFNAMSIZ - 3)


def mac_for(ip: str) -> str:
    """A locally administered unicast MAC from the address: ``02:vf:`` + the address's 4 bytes."""
    b = ipaddress.IPv4Address(ip).packed
    return "02:76:" + ":".join(f"{x:02x}" for x in b)


def parse_cidr(text: str) -> ipaddress.IPv4Network:
    """An IPv4 subnet with room for a gateway and at least one VM (prefix 8..29)."""
    try:
        net = ipaddress.IPv4Network(text.strip(), strict=True)
    except ValueError as e:
        raise ValueError(f"is not an IPv4 subnet (e.g. 10.240.7.0/24): {e}") from None
    if not 8 <= net.prefixlen <= 29:
        raise ValueError("needs a prefix between /8 and /29")
    return net


# ---------------------------------------------------------------------------------- the pool (pure)


@dataclass(frozen=True)
class AddressPool:
    """The addresses of one subnet: the first is the gateway, the broadcast is nobody's."""

    subnet: ipaddress.IPv4Network

    @property
    def gateway(self) -> str:
        return str(self.subnet.network_address + 1)

    @property
    def size(self) -> int:
        return self.subnet.num_addresses - 3  # network, gateway, broadcast

    def addresses(self) -> Iterable[str]:
        first = int(self.subnet.network_address) + 2
        last = int(self.subnet.broadcast_address) - 1
        for i in range(first, last + 1):
            yield str(ipaddress.IPv4Address(i))

    def __contains__(self, ip: object) -> bool:
        try:
            a = ipaddress.IPv4Address(str(ip))
        except ValueError:
            return False
        return a in self.subnet and str(a) != self.gateway and a not in (
            self.subnet.network_address, self.subnet.broadcast_address)

    def pick(self, taken: Iterable[str], after: str | None = None) -> str | None:
        """The first address not in ``taken``, starting after ``after`` (round robin: a released
        address is the last to be handed out again), None when every one is taken."""
        held = set(taken)
        first = int(self.subnet.network_address) + 2
        n = self.size
        if n <= 0:
            return None
        start = 0
        if after is not None and after in self:
            start = int(ipaddress.IPv4Address(after)) - first + 1
        for k in range(n):
            a = str(ipaddress.IPv4Address(first + (start + k) % n))
            if a not in held:
                return a
        return None

    def attach(self, ip: str, *, tap: str = "", bridge: str = "") -> NetAttach:
        return NetAttach(ip=ip, prefix=self.subnet.prefixlen, gateway=self.gateway, mac=mac_for(ip),
                         tap=tap, bridge=bridge)


def candidate_subnets(pool: ipaddress.IPv4Network, host: str,
                      prefix: int = HOST_PREFIX) -> list[ipaddress.IPv4Network]:
    """The /24s (``prefix``) of ``pool`` in the order an agent named ``host`` tries them."""
    if pool.prefixlen >= prefix:
        return [pool]
    subs = list(pool.subnets(new_prefix=prefix))
    start = fnv1a(host) % len(subs)
    return subs[start:] + subs[:start]


# ---------------------------------------------------------------------------------- the host's network


class _Saved(msgspec.Struct):
    subnet: str
    bridge: str


def _lease_owner(fd: int) -> str:
    """The data directory of the agent that last leased the subnet (the lease file's content)."""
    try:
        return os.pread(fd, 4096, 0).decode(errors="replace").strip()
    except OSError:
        return ""


def _still_claims(data_dir: str, net: ipaddress.IPv4Network) -> bool:
    """The agent of ``data_dir`` recorded ``net`` as its subnet and its directory still exists: a
    killed agent keeps its subnet for its restart (another agent taking it meanwhile would leave
    the first unable to start, with VMs still on those addresses)."""
    try:
        with open(os.path.join(data_dir, NETWORK_FILE), "rb") as f:
            saved = msgspec.json.decode(f.read(), type=_Saved)
    except (OSError, msgspec.DecodeError):
        return False
    return saved.subnet == str(net)


def lease_dir() -> str:
    base = os.environ.get(LEASE_DIR_ENV) or ("/run/vmfence/pools" if os.access("/run", os.W_OK)
                                             else os.path.join(tempfile.gettempdir(), "vmfence-pools"))
    os.makedirs(base, mode=0o755, exist_ok=True)
    return base


@dataclass
class HostNetwork:
    """One agent's pool, and (mode bridge with taps) its bridge. ``open()`` leases the subnet and
    makes the bridge; ``close()`` drops the lease; ``teardown()`` deletes the bridge (throw-away
    stacks, after their VMs are gone)."""

    mode: NetworkMode
    data_dir: str
    host: str
    subnet: ipaddress.IPv4Network | None = None  # explicit --pod-cidr
    pool_cidr: ipaddress.IPv4Network = field(default_factory=lambda: parse_cidr(DEFAULT_POD_CIDR_POOL))
    taps: bool = True  # make a bridge and taps (qemu); the sim allocates addresses only
    host_prefix: int = HOST_PREFIX  # the size of the subnet leased out of pool_cidr
    pool: AddressPool | None = field(default=None, init=False)
    bridge: str = field(default="", init=False)
    _lease_fd: int | None = field(default=None, init=False, repr=False)

    @property
    def enabled(self) -> bool:
        return self.mode == "bridge"

    @property
    def gateway(self) -> str | None:
        return self.pool.gateway if self.pool is not None else None

    async def open(self) -> None:
        if not self.enabled:
            return
        self.bridge = bridge_name(self.data_dir) if self.taps else ""
        saved = self._load()
        if self.subnet is not None and saved is not None and str(self.subnet) != saved.subnet:
            raise NetworkError(f"--pod-cidr {self.subnet} differs from {saved.subnet}, which this host's VMs use "
                               f"({os.path.join(self.data_dir, NETWORK_FILE)}); remove their VMs first")
        used = await used_subnets() if self.taps else {}
        theirs = [n for ifname, nets in used.items() if ifname != self.bridge for n in nets]
        if saved is not None or self.subnet is not None:
            chosen = parse_cidr(saved.subnet) if saved is not None else self.subnet
            assert chosen is not None
            why = self._unusable(chosen, theirs)
            if why is not None:
                raise NetworkError(f"pod subnet {chosen}: {why}")
        else:
            chosen = None
            for cand in candidate_subnets(self.pool_cidr, self.host, self.host_prefix):
                if self._unusable(cand, theirs) is None:
                    chosen = cand
                    break
            if chosen is None:
                raise NetworkError(f"no free /{self.host_prefix} left in --pod-cidr-pool {self.pool_cidr}")
        self.pool = AddressPool(chosen)
        self._save()
        if self.taps:
            await self._make_bridge()
            await self.sweep()
        log.info("pod network %s on bridge %s (gateway %s)", chosen, self.bridge or "-", self.pool.gateway,
                 extra={"host": self.host, "event": "network"})

    def _unusable(self, net: ipaddress.IPv4Network, theirs: list[ipaddress.IPv4Network]) -> str | None:
        """Why ``net`` cannot be this agent's (taken by another interface or agent), else None; on
        None the lease is held."""
        clash = next((n for n in theirs if n.overlaps(net)), None)
        if clash is not None:
            return f"overlaps {clash}, already configured on this machine"
        path = os.path.join(lease_dir(), f"{net.network_address}_{net.prefixlen}.lock")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return "held by another agent on this machine"
        owner = _lease_owner(fd)
        mine = os.path.abspath(self.data_dir)
        if owner and owner != mine and _still_claims(owner, net):
            os.close(fd)  # its agent is down, not gone: its VMs may still run on these addresses
            return f"kept for the agent of {owner}, which is not running (its VMs may use it)"
        os.ftruncate(fd, 0)
        os.pwrite(fd, mine.encode(), 0)
        self._release_lease()
        self._lease_fd = fd
        return None

    def _release_lease(self) -> None:
        if self._lease_fd is not None:
            os.close(self._lease_fd)
            self._lease_fd = None

    def _load(self) -> _Saved | None:
        try:
            with open(os.path.join(self.data_dir, NETWORK_FILE), "rb") as f:
                return msgspec.json.decode(f.read(), type=_Saved)
        except FileNotFoundError:
            return None
        except msgspec.DecodeError as e:
            raise NetworkError(f"{os.path.join(self.data_dir, NETWORK_FILE)} is unreadable: {e}") from None

    def _save(self) -> None:
        assert self.pool is not None
        path = os.path.join(self.data_dir, NETWORK_FILE)
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(msgspec.json.encode(_Saved(str(self.pool.subnet), self.bridge)))
        os.replace(tmp, path)

    async def _make_bridge(self) -> None:
        assert self.pool is not None
        cur = await link(self.bridge)
        if cur is not None and not owned(cur, self.bridge):
            raise NetworkError(f"interface {self.bridge} exists and was not created by vmfence")
        if cur is None:
            await run_ip("link", "add", "name", self.bridge, "type", "bridge")
            await run_ip("link", "set", "dev", self.bridge, "alias", ALIAS_PREFIX + self.bridge)
        gw = f"{self.pool.gateway}/{self.pool.subnet.prefixlen}"
        have = (await used_subnets()).get(self.bridge, [])
        if self.pool.subnet not in have:
            await run_ip("addr", "replace", gw, "dev", self.bridge)
        await run_ip("link", "set", "dev", self.bridge, "up")

    async def sweep(self) -> list[str]:
        """Delete the bridges of agents that are gone: a bridge vmfence made (its alias), with no
        port (no VM's tap on it) and whose subnet's lease nobody holds (its agent is not running).
        The lease is held while the bridge is deleted, so its agent cannot start on it meanwhile."""
        all_links = await links()
        masters = {str(i.get("master")) for i in all_links if i.get("master")}
        nets = await used_subnets()
        gone = []
        for item in all_links:
            name = str(item.get("ifname"))
            if name == self.bridge or not owned(item, name) or name in masters:
                continue
            for net in nets.get(name, []):
                path = os.path.join(lease_dir(), f"{net.network_address}_{net.prefixlen}.lock")
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    os.close(fd)
                    break  # its agent runs
                try:
                    if await delete_link(name, name):
                        gone.append(name)
                finally:
                    os.close(fd)
                break
        if gone:
            log.info("deleted the bridges of agents that are gone: %s", ", ".join(gone),
                     extra={"host": self.host, "event": "network_swept"})
        return gone

    def attach(self, vm_id: str, ip: str) -> NetAttach:
        assert self.pool is not None
        return self.pool.attach(ip, tap=tap_name(self.bridge, vm_id) if self.taps else "", bridge=self.bridge)

    async def stray_taps(self, keep: Iterable[str]) -> list[str]:
        """Taps this agent made (alias) that no VM in ``keep`` (vm tap names) uses."""
        if not self.taps or not self.bridge:
            return []
        wanted = set(keep)
        return sorted(str(i["ifname"]) for i in await links()
                      if owned(i, self.bridge) and i.get("ifname") != self.bridge and i.get("ifname") not in wanted)

    async def teardown(self) -> None:
        """Delete this agent's taps and bridge (only interfaces with its alias)."""
        if not self.taps or not self.bridge:
            return
        for name in await self.stray_taps(()):
            await delete_link(name, self.bridge)
        await delete_link(self.bridge, self.bridge)

    def close(self, *, keep_claim: bool = True) -> None:
        """Drop the lease. ``keep_claim``: this agent's VMs still hold addresses of the subnet, so it
        stays recorded as the subnet's (a restart gets it back); without any, the record is cleared
        and the subnet is free for another agent (a stopped test stack's must not pin one forever)."""
        if not keep_claim and self._lease_fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._lease_fd, 0)
        self._release_lease()


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


async def remove_network(data_dir: str) -> list[str]:
    """Delete the bridge and taps the agent of ``data_dir`` made (per its network.json; only
    interfaces with its alias); the names deleted. For throw-away stacks and tests, after their
    VMs are gone."""
    try:
        raw = await asyncio.to_thread(_read, os.path.join(data_dir, NETWORK_FILE))
        saved = msgspec.json.decode(raw, type=_Saved)
    except (FileNotFoundError, msgspec.DecodeError):
        return []
    if not saved.bridge:
        return []
    gone = []
    for item in await links():
        name = str(item.get("ifname"))
        if owned(item, saved.bridge) and name != saved.bridge and await delete_link(name, saved.bridge):
            gone.append(name)
    if await delete_link(saved.bridge, saved.bridge):
        gone.append(saved.bridge)
    return gone


__all__ = [
    "ADDRESS_KIND",
    "DEFAULT_POD_CIDR_POOL",
    "NETWORK_FILE",
    "NETWORK_MODES",
    "SIM_HOST_PREFIX",
    "SIM_POD_CIDR_POOL",
    "AddressPool",
    "HostNetwork",
    "NetworkError",
    "NetworkMode",
    "PoolExhausted",
    "bridge_name",
    "candidate_subnets",
    "delete_tap",
    "ensure_tap",
    "mac_for",
    "parse_cidr",
    "remove_network",
    "tap_name",
]
