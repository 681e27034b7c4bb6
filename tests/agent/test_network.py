"""Pod networking and collection on the agent (issue 12 §1, §4), through the executor with the
sim runtime (addresses from the pool, no taps) and a real ledger: every address is a reservation of
the VM's fence, allocated before the VM starts, released only after it is gone, kept across a
restart and a hibernate/wake; a full pool is a failed result with a reason; snapshots are dropped
after the wake that used them and collected when nobody holds them — never while a wake may use them.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from services.agent.collect import Collector, snapshot_base
from services.agent.executor import Executor
from services.agent.ledger import ADDRESS_KIND, LEDGER_FILE, Ledger
from services.agent.metrics import AgentMetrics
from services.agent.network import AddressPool, HostNetwork, NetworkError, candidate_subnets, mac_for, parse_cidr
from services.agent.runtime.sim import SimDriver
from services.agent.service import Agent

from .conftest import command, fence, sim_driver


@pytest.fixture(autouse=True)
def _leases(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Machine-wide pool leases of these tests live in the test's own directory."""
    monkeypatch.setenv("VMFENCE_NET_LEASE_DIR", str(tmp_path / "leases"))


@dataclass
class Host:
    ledger: Ledger
    driver: SimDriver
    network: HostNetwork
    executor: Executor
    collector: Collector


async def open_host(root: Path, name: str = "h1", cidr: str | None = None) -> Host:
    os.makedirs(root, exist_ok=True)
    ledger = Ledger(str(root / LEDGER_FILE))
    await ledger.open()
    net = HostNetwork("bridge", str(root), name, subnet=parse_cidr(cidr) if cidr else None, taps=False)
    await net.open()
    driver = SimDriver(state_dir=str(root / "runtime"))
    await driver.open()
    (root / "snapshots").mkdir(exist_ok=True)
    ex = Executor(ledger, driver, name, str(root / "snapshots"), vnc=False, network=net)
    return Host(ledger, driver, net, ex, Collector(ex, AgentMetrics(), grace_s=0.0))


async def close_host(h: Host) -> None:
    await h.driver.close()
    h.network.close()
    await h.ledger.close()


@pytest.fixture
async def host(tmp_path: Path) -> AsyncIterator[Host]:
    h = await open_host(tmp_path / "h1", cidr="10.99.0.0/29")  # 5 addresses: .2 .. .6
    try:
        yield h
    finally:
        await close_host(h)


def exists(path: str) -> bool:
    return os.path.exists(path)  # a local file's: sub-millisecond


async def held(h: Host) -> dict[str, tuple[str, str, int]]:
    """The ledger's addresses (its in-memory mirror), checked against its file."""
    mirror = await h.ledger.held(ADDRESS_KIND)
    rows = {r: (v, u, e) for r, v, u, e, _ in await h.ledger.reserved_since(ADDRESS_KIND)}
    assert mirror == rows, "the address mirror drifted from the ledger file"
    return mirror


# ------------------------------------------------------------------------------ the pool (pure)


def test_pool_gateway_addresses_and_round_robin() -> None:
    pool = AddressPool(ipaddress.IPv4Network("10.1.2.0/29"))
    assert pool.gateway == "10.1.2.1" and pool.size == 5
    assert list(pool.addresses()) == [f"10.1.2.{i}" for i in range(2, 7)]
    assert "10.1.2.1" not in pool and "10.1.2.7" not in pool and "10.1.2.0" not in pool and "10.1.2.4" in pool
    assert pool.pick([]) == "10.1.2.2"
    assert pool.pick(["10.1.2.2"], after="10.1.2.2") == "10.1.2.3"
    # a released address is handed out last: after .5, the next is .6, then back to .2
    assert pool.pick(["10.1.2.3"], after="10.1.2.5") == "10.1.2.6"
    assert pool.pick(["10.1.2.6", "10.1.2.3"], after="10.1.2.5") == "10.1.2.2"
    assert pool.pick(list(pool.addresses())) is None
    att = pool.attach("10.1.2.4")
    assert (att.ip, att.prefix, att.gateway, att.mac) == ("10.1.2.4", 29, "10.1.2.1", "02:76:0a:01:02:04")
    assert mac_for("10.1.2.4") != mac_for("10.1.2.5")


def test_a_big_pool_picks_fast_and_in_order() -> None:
    pool = AddressPool(ipaddress.IPv4Network("127.1.0.0/16"))
    held: set[str] = set()
    last = None
    for _ in range(3000):  # as a scale bench's allocations: each is O(1) while addresses are free
        last = pool.pick(held, after=last)
        assert last is not None and last not in held
        held.add(last)
    assert last == "127.1.11.185"  # .2 + 2999


def test_candidate_subnets_are_the_pool_s_24s_from_a_slot_of_the_host() -> None:
    pool = ipaddress.IPv4Network("10.240.0.0/16")
    a, b = candidate_subnets(pool, "host-a"), candidate_subnets(pool, "host-b")
    assert len(a) == 256 and set(a) == set(b) and all(n.prefixlen == 24 and n.subnet_of(pool) for n in a)
    assert a[0] != b[0]


async def test_two_hosts_on_one_machine_never_lease_the_same_subnet(tmp_path: Path) -> None:
    """Same host name (as two concurrent stacks have), same pool: the machine-wide lease makes the
    second take the next /24; a restart takes its recorded subnet again."""
    nets = []
    for d in ("a", "b"):
        n = HostNetwork("bridge", str(tmp_path / d), "host-a", taps=False)
        (tmp_path / d).mkdir()
        await n.open()
        nets.append(n)
    s0, s1 = (n.pool.subnet for n in nets if n.pool)
    assert s0 != s1 and not s0.overlaps(s1)
    nets[0].close()
    again = HostNetwork("bridge", str(tmp_path / "a"), "host-a", taps=False)
    await again.open()
    assert again.pool is not None and again.pool.subnet == s0  # from network.json
    # an explicit CIDR another agent holds is a clear start error
    clash = HostNetwork("bridge", str(tmp_path / "c"), "host-c", subnet=s1, taps=False)
    (tmp_path / "c").mkdir()
    with pytest.raises(NetworkError, match="held by another agent"):
        await clash.open()
    for n in (nets[1], again, clash):
        n.close()


# ------------------------------------------------------------------------------ addresses are the fence's


async def test_each_vm_gets_its_own_address_and_the_result_carries_it(host: Host) -> None:
    ips = []
    for i in range(3):
        r, _ = await host.executor.execute(command("create", f"vm-{i}", fence(1, key=f"default/p{i}")))
        assert r.outcome == "ok", r
        ips.append(r.ip)
    assert len(set(ips)) == 3 and all(ip in host.network.pool for ip in ips)  # type: ignore[operator]
    owners = await held(host)
    assert {ip: o[0] for ip, o in owners.items()} == {ip: f"vm-{i}" for i, ip in enumerate(ips)}
    # a redelivered create answers the same address (and reserves nothing new)
    r, replayed = await host.executor.execute(command("create", "vm-0", fence(1, key="default/p0")))
    assert replayed and r.ip == ips[0] and len(await held(host)) == 3


async def test_a_full_pool_is_a_failed_result_with_the_reason(host: Host) -> None:
    for i in range(5):
        r, _ = await host.executor.execute(command("create", f"f-{i}", fence(1, key=f"default/f{i}")))
        assert r.outcome == "ok"
    r, _ = await host.executor.execute(command("create", "f-5", fence(1, key="default/f5")))
    assert r.outcome == "failed" and r.error and "10.99.0.0/29" in r.error and "full" in r.error, r
    assert "f-5" not in host.driver.all_vms() and host.ledger.vm("f-5") is None
    # once a VM is removed its address is free again, and the next create gets it
    assert (await host.executor.execute(command("remove", "f-2", fence(1, key="default/f2"))))[0].outcome == "ok"
    r, _ = await host.executor.execute(command("create", "f-6", fence(1, key="default/f6")))
    assert r.outcome == "ok" and r.ip == "10.99.0.4"


async def test_a_successor_never_gets_the_address_its_predecessor_s_vm_may_still_use(host: Host) -> None:
    old, new = fence(1), fence(2)
    r1, _ = await host.executor.execute(command("create", "p-1", old))
    r2, _ = await host.executor.execute(command("create", "p-2", new))  # predecessor's VM still runs
    assert r1.ip != r2.ip
    assert (await held(host))[r1.ip] == ("p-1", old.uid, old.epoch)  # type: ignore[index]
    # a failed remove (the runtime could not kill it) keeps the address with the predecessor
    host.driver.faults.fail("remove", vm_id="p-1")
    rm, _ = await host.executor.execute(command("remove", "p-1", old, cid="rm-fails"))
    assert rm.outcome == "failed" and (await held(host))[r1.ip][0] == "p-1"  # type: ignore[index]
    rm, _ = await host.executor.execute(command("remove", "p-1", old))
    assert rm.outcome == "ok" and r1.ip not in await held(host)


async def test_addresses_survive_an_agent_restart(tmp_path: Path) -> None:
    h = await open_host(tmp_path / "r", cidr="10.98.0.0/29")
    r, _ = await h.executor.execute(command("create", "keep", fence(1)))
    await close_host(h)
    h = await open_host(tmp_path / "r", cidr="10.98.0.0/29")
    try:
        assert (await held(h))[r.ip][0] == "keep"  # type: ignore[index]
        r2, _ = await h.executor.execute(command("create", "other", fence(1, key="default/other")))
        assert r2.ip != r.ip and r2.outcome == "ok"
    finally:
        await close_host(h)


async def test_hibernate_and_wake_keep_the_address_and_drop_the_snapshot(host: Host) -> None:
    f = fence(1)
    up, _ = await host.executor.execute(command("create", "h-1", f))
    hib, _ = await host.executor.execute(command("hibernate", "h-1", f))
    assert hib.outcome == "ok" and hib.snapshot and exists(hib.snapshot)
    assert (await held(host))[up.ip] == ("h-1", f.uid, f.epoch)  # type: ignore[index]  # kept while hibernated
    # another VM created meanwhile does not get it
    other, _ = await host.executor.execute(command("create", "o-1", fence(1, key="default/o")))
    assert other.ip != up.ip
    wake, _ = await host.executor.execute(command("wake", "h-2", f, snapshot=hib.snapshot))
    assert wake.outcome == "ok" and wake.ip == up.ip, wake
    assert (await held(host))[up.ip] == ("h-2", f.uid, f.epoch)  # type: ignore[index]
    assert not exists(hib.snapshot)  # the wake took: the snapshot has served
    assert await host.ledger.reservation_owner("snapshot", hib.snapshot) is None
    # deleting the pod removes the woken VM: nothing is left
    assert (await host.executor.execute(command("remove", "h-2", f)))[0].outcome == "ok"
    assert up.ip not in await held(host)


async def test_removing_a_hibernated_vm_collects_its_snapshot_and_address(host: Host) -> None:
    f = fence(1)
    up, _ = await host.executor.execute(command("create", "d-1", f))
    hib, _ = await host.executor.execute(command("hibernate", "d-1", f))
    assert hib.snapshot and exists(hib.snapshot)
    rm, _ = await host.executor.execute(command("remove", "d-1", f))
    assert rm.outcome == "ok", rm
    assert not exists(hib.snapshot) and up.ip not in await held(host)
    assert await host.ledger.reservation_owner("snapshot", hib.snapshot) is None


# ------------------------------------------------------------------------------ the collector


def test_snapshot_base_names_every_file_of_a_snapshot() -> None:
    assert snapshot_base("a.snap") == "a.snap"
    assert snapshot_base("a.snap.disk.qcow2") == "a.snap"
    assert snapshot_base("a.snap.part") == "a.snap"
    assert snapshot_base("a.snap.disk.qcow2.part") == "a.snap"
    assert snapshot_base(".snap") is None and snapshot_base("ledger.sqlite3") is None


async def test_collector_deletes_unheld_snapshots_after_the_grace_and_never_a_held_one(host: Host) -> None:
    f = fence(1)
    await host.executor.execute(command("create", "c-1", f))
    hib, _ = await host.executor.execute(command("hibernate", "c-1", f))
    assert hib.snapshot
    stray = Path(host.executor.snapshot_dir) / "gone-1.snap"
    stray.write_bytes(b"x" * 1000)
    (Path(host.executor.snapshot_dir) / "gone-1.snap.disk.qcow2").write_bytes(b"y" * 24)
    host.collector.grace_s = 3600.0
    out = await host.collector.collect()
    assert out.snapshots == 0 and stray.exists()  # within the grace period
    host.collector.grace_s = 0.0
    out = await host.collector.collect()
    assert (out.snapshots, out.snapshot_bytes) == (1, 1024) and not stray.exists()
    assert exists(hib.snapshot) and out.held_snapshots == 1  # held by the hibernated VM
    m = host.collector.metrics.registry
    assert m.get_sample_value("vmfence_agent_collected_total", {"kind": "snapshot"}) == 1
    assert m.get_sample_value("vmfence_agent_collected_bytes_total") == 1024
    assert m.get_sample_value("vmfence_agent_snapshots") == 1
    assert m.get_sample_value("vmfence_agent_addresses", {"state": "held"}) == 1  # the hibernated VM's


async def test_collection_raced_against_wake_never_takes_a_live_incarnation_s_snapshot(host: Host) -> None:
    """Collector passes (grace 0) run back to back while hibernated VMs wake: every wake restores
    its own memory (the sim's token), and only snapshots the wakes finished with disappear."""
    rounds = 12
    for i in range(rounds):
        f = fence(1, key=f"default/race{i}")
        up, _ = await host.executor.execute(command("create", f"r{i}-a", f))
        assert up.outcome == "ok", up
        token = host.driver.memory_token(f"r{i}-a")
        hib, _ = await host.executor.execute(command("hibernate", f"r{i}-a", f))
        assert hib.outcome == "ok" and hib.snapshot
        host.driver._snapshots.clear()  # the sim must read the file, as QEMU does
        stop = asyncio.Event()

        async def collect_until_stopped(stop: asyncio.Event = stop) -> int:
            n = 0
            while not stop.is_set():
                await host.collector.collect()
                n += 1
                await asyncio.sleep(0)
            return n

        host.driver.faults.delay("restore", 0.01 * (i % 4))  # the collector runs during the restore
        collector = asyncio.create_task(collect_until_stopped())
        await asyncio.sleep(0)
        wake, _ = await host.executor.execute(command("wake", f"r{i}-b", f, snapshot=hib.snapshot))
        stop.set()
        passes = await collector
        assert wake.outcome == "ok", (i, wake)
        assert host.driver.memory_token(f"r{i}-b") == token, "woke from something else than its own snapshot"
        assert wake.ip == up.ip and passes >= 1
        rm, _ = await host.executor.execute(command("remove", f"r{i}-b", f))
        assert rm.outcome == "ok"
    assert await held(host) == {}
    assert os.listdir(host.executor.snapshot_dir) == []


async def test_collector_releases_an_address_whose_vm_never_got_its_intent_row(host: Host) -> None:
    """An agent that died between reserving an address and recording its intent leaves a
    reservation no VM has: released once the runtime confirms there is no VM under it."""
    f = fence(1)
    await host.ledger.reserve(ADDRESS_KIND, "10.99.0.6", "ghost", f)
    r, _ = await host.executor.execute(command("create", "live", fence(1, key="default/live")))
    out = await host.collector.collect()
    assert out.addresses == 1 and set(await held(host)) == {r.ip}


async def test_a_sim_agent_s_addresses_are_loopback_ones(make_config: Any, nc: Any, reports: Any) -> None:
    """Anything that connects to a sim VM's address (a pod-spec probe) stays on this machine."""
    cfg = make_config()
    async with Agent(cfg, driver=sim_driver(cfg)) as agent:
        assert agent.network.pool is not None
        assert agent.network.pool.subnet.subnet_of(ipaddress.IPv4Network("127.0.0.0/8"))
        assert agent.network.pool.size == 65533  # a scale bench puts thousands of VMs on a sim host
        assert agent.host_ip is None  # no interface has the sim's gateway


async def test_a_vm_adopted_without_a_ledger_row_keeps_its_address_reserved(tmp_path: Path) -> None:
    """The ledger was lost (replaced): a VM the runtime still runs is adopted with the address it has,
    so a new VM never gets it."""
    h = await open_host(tmp_path / "a", cidr="10.97.0.0/29")
    try:
        r, _ = await h.executor.execute(command("create", "keep-1", fence(1)))
        assert r.outcome == "ok" and r.ip
        await h.ledger.close()
        os.unlink(h.ledger.path)  # the ledger is gone; the VM runs on
        fresh = Ledger(h.ledger.path)
        await fresh.open()
        h.ledger = fresh
        h.executor.ledger = fresh
        # at start, before the adopt, the address the runtime's VM has is reserved for its labels' fence
        assert await h.executor.reserve_runtime_addresses() == 1
        assert (await held(h))[r.ip] == ("keep-1", "uid-1", 1)
        early, _ = await h.executor.execute(command("create", "early-1", fence(1, key="default/early")))
        assert early.outcome == "ok" and early.ip != r.ip
        a, _ = await h.executor.execute(command("adopt", "keep-1", fence(2)))
        assert a.outcome == "ok" and a.ip == r.ip, a
        assert (await held(h))[r.ip] == ("keep-1", "uid-2", 2)
        other, _ = await h.executor.execute(command("create", "new-1", fence(1, key="default/new")))
        assert other.outcome == "ok" and other.ip != r.ip
    finally:
        await close_host(h)


async def test_a_killed_agents_subnet_is_kept_for_its_restart(tmp_path: Path) -> None:
    """The lease's flock dies with a SIGKILLed agent; another agent with the same host name (another
    stack on the machine) starting meanwhile must not take that subnet — the first agent's VMs may
    still use its addresses, and its restart insists on its network.json. A subnet whose agent's
    directory is gone is free again."""
    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    a_dir.mkdir()
    b_dir.mkdir()
    a = HostNetwork("bridge", str(a_dir), "host-b", taps=False)
    await a.open()
    assert a.pool is not None
    mine = a.pool.subnet
    a.close()  # as if killed: the flock is gone, network.json stays
    b = HostNetwork("bridge", str(b_dir), "host-b", taps=False)
    await b.open()
    assert b.pool is not None and b.pool.subnet != mine
    again = HostNetwork("bridge", str(a_dir), "host-b", taps=False)
    await again.open()  # its own subnet back
    assert again.pool is not None and again.pool.subnet == mine
    again.close()
    b.close()
    shutil.rmtree(a_dir)  # that agent is gone for good: its subnet is free
    c_dir = tmp_path / "c"
    c_dir.mkdir()
    c = HostNetwork("bridge", str(c_dir), "host-b", taps=False)
    await c.open()
    assert c.pool is not None and c.pool.subnet == mine
    # a clean stop with no VM holding an address gives the subnet up (stopped stacks must not pin
    # the pool: a test session starts hundreds of agents whose directories all outlive them)
    c.close(keep_claim=False)
    d_dir = tmp_path / "d"
    d_dir.mkdir()
    d = HostNetwork("bridge", str(d_dir), "host-b", taps=False)
    await d.open()
    assert d.pool is not None and d.pool.subnet == mine
    d.close()
