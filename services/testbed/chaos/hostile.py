"""`vmfence chaos --hostile`: a seeded attacker and a careless user against a real local stack.

Each seed runs batches. A batch publishes, with each identity's own NATS permissions in turn
(watcher, every agent, audit), undecodable bytes and valid-schema messages with hostile values
(huge and negative epochs, wrong keys, wrong hosts, unknown versions, oversized fields, replayed and
future command ids, forged commands and log entries); it sends each valid-schema lie once more with
an agent's own credentials on its own subject, so that only the fence stands in its way; and it
creates pods with hostile annotations and names through the API. After every batch a probe pod must
reach Running within a bound: one bad object never stops, wedges or slows another key. Oracles over
the whole run: no component crashed; no VM was created or removed by a message (the VMs of the
steady pods are the same before and after every batch, and every VM belongs to a pod someone
created); `vmfence verify` finds no drift; the audit is clean.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import nats
import nats.errors
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from services.testbed.stack import LocalStack
from shared.bus.logstream import audit_records, read_log
from shared.fence.keys import Key
from shared.fence.schema import (
    CommandResult,
    Fence,
    Inventoried,
    ProbeChanged,
    Skipped,
    VMExited,
    VMGone,
    encode,
)

NS = "default"
HOSTS = ("host-a", "host-b")
STEADY = 3  # pods that must keep their VMs through every batch
PROBE_BOUND_S = 45.0  # a probe pod created after a batch is Running within this
SETTLE_S = 30.0
MESSAGES_PER_BATCH = 40
HOSTILE_PODS_PER_BATCH = 3
BIG = 250 * 1024  # an annotation's size that made a log entry exceed the server's max payload


@dataclass
class Tally:
    messages: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    refused_by_permissions: int = 0
    hostile_pods: int = 0
    probes: int = 0
    wedged_keys: list[str] = field(default_factory=list)
    crashes: list[str] = field(default_factory=list)
    vm_changes: list[str] = field(default_factory=list)

    def sent(self, kind: str, identity: str) -> None:
        self.messages[kind][identity] += 1


def _pod(name: str, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": {"vmfence.io/managed": "true"}, "annotations": annotations or {}},
        "spec": {"containers": [{"name": "main", "image": "vm"}]},
    }


# ------------------------------------------------------------------------------------- hostile input
HOSTILE_ANNOTATIONS: list[dict[str, str]] = [
    {"vmfence.io/cpus": "9" * 5000},
    {"vmfence.io/memory": "9" * 4301 + "Gi"},
    {"vmfence.io/probe-port": "-1"},
    {"vmfence.io/probe-port": "99999999999999999999"},
    {"vmfence.io/image": "../../../../etc/passwd"},
    {"vmfence.io/image": "/etc/shadow"},
    {"vmfence.io/image": "a\u0000b"},
    {"vmfence.io/on-recreate": "maybe"},
    {"vmfence.io/hibernate": "perhaps"},
    {"vmfence.io/memory": "1Ti9"},
    {"vmfence.io/cpus": "0x10"},
    {"vmfence.io/cpus": "\u0661\u0662"},  # Arabic-Indic digits: isdigit() but not [0-9]
    {"vmfence.io/notes": "x" * BIG},
]


def _hostile_name(rng: random.Random, i: int) -> str:
    """Valid DNS subdomains that stress encoding: dots, dashes, maximal length."""
    choice = rng.randrange(4)
    if choice == 0:
        return f"h{i}." + ".".join("a" * 20 for _ in range(5))
    if choice == 1:
        return (f"h{i}-" + "z" * 250)[:253]
    if choice == 2:
        return f"h{i}.x-y.0.--.z"
    return f"h{i}-{rng.randrange(10**6)}"


def _fence_json(key: str, uid: str, epoch: int | str) -> str:
    return json.dumps([key, uid, 0]).replace(", 0]", f", {epoch}]")


# What the agent of the VM's own host may legitimately claim: a fence above the log's epoch, or a VM
# of another uid at a higher epoch, is evidence of a lost log tail (decide.cut_evidence) when that
# host says it, and a rebuild follows by design. From its own host these are not hostile; the
# campaign sends them as everyone else (whom NATS refuses, or the log's placement contradicts).
HOST_EVIDENCE_KINDS = frozenset({"future_command", "foreign_inventory"})

# Lies an agent may send with its own credentials on its own subject for the key the payload names,
# so that NATS and the subject checks let them through and only the fence stands in the way: each
# round sends each of these once that way, besides the random sends (which mostly meet a refusal or
# a subject that names another key first). A wrong-host lie comes from the other host's agent, the
# rest from the VM's own host's agent.
AUTHORISED_LIES = frozenset({"future_epoch", "wrong_host", "wrong_host_exit", "replayed_command_id", "stale_probe"})


def _hostile_messages(rng: random.Random,
                      live: dict[str, tuple[str, str, str, int]]) -> tuple[str, str, list[tuple[str, bytes]]]:
    """The lies' key, the VM's host and (kind, payload) pairs; ``live`` maps key -> (uid, host,
    vm_id, epoch) of the steady pods."""
    key, (uid, host, vm_id, epoch) = rng.choice(sorted(live.items()))
    other_host = next(h for h in HOSTS if h != host)
    f = Fence(key, uid, epoch)
    out: list[tuple[str, bytes]] = [
        ("garbage", rng.randbytes(rng.randrange(0, 600))),
        ("garbage_json", b'{"type": "result", "fence": [1, 2, 3, 4], "command_id": null}'),
        ("unknown_type", b'{"type": "teleport", "fence": ["%s", "%s", 1]}' % (key.encode(), uid.encode())),
    ]
    for big in (1000, 2**63 - 1, 2**64 - 1, 2**70, -5):
        body = json.dumps({"type": "vm_gone", "fence": "FENCE", "host": host, "vm_id": vm_id})
        body = body.replace('"FENCE"', _fence_json(key, uid, big))
        out.append(("future_epoch" if big > 0 else "negative_epoch", body.encode()))
    out += [
        ("wrong_host", encode(VMGone(fence=f, host=other_host, vm_id=vm_id))),
        ("wrong_host_exit", encode(VMExited(fence=f, host=other_host, vm_id=vm_id))),
        ("wrong_key", encode(VMGone(fence=Fence(f"{NS}/someone-else", uid, epoch), host=host, vm_id=vm_id))),
        ("unknown_version", encode(VMGone(fence=f, host=host, vm_id=vm_id, v=99))),
        ("oversized", encode(ProbeChanged(fence=f, host=host, vm_id="v" * (300 * 1024), ready=True))),
        ("replayed_command_id", encode(CommandResult(fence=f, command_id="never-sent", op="remove", host=host,
                                                     vm_id=vm_id, outcome="ok"))),
        ("future_command", encode(CommandResult(fence=Fence(key, uid, epoch + 7), command_id=f"{uid}:{epoch + 7}:x",
                                                op="create", host=host, vm_id=vm_id, outcome="ok"))),
        ("stale_probe", encode(ProbeChanged(fence=Fence(key, "an-old-uid", max(1, epoch - 1)), host=host,
                                            vm_id=vm_id, ready=False))),
        ("foreign_inventory", encode(Inventoried(fence=Fence(key, "intruder", epoch + 1), host=host,
                                                 vm_id="intruder-vm", state="running"))),
    ]
    rng.shuffle(out)
    return key, host, out


def _identity(stack: LocalStack, user: str) -> tuple[str, str | None]:
    """The URL and password a local stack gives this NATS user (no password: a stack without auth)."""
    assert stack.nats is not None
    identity = getattr(stack, "identity", None)
    if identity is None:
        return stack.nats.url, None
    url, password = identity(user)
    return str(url), password


# ---------------------------------------------------------------------------------------- the run
class HostileCampaign:
    def __init__(self, root: Path, seeds: int, first: int, progress: Callable[[str], None]) -> None:
        self.root, self.seeds, self.first, self.progress = root, seeds, first, progress
        self.tally = Tally()

    async def _identities(self, stack: LocalStack) -> dict[str, nats.NATS]:
        """One connection per identity, each counting the permission violations the server sends."""
        out: dict[str, nats.NATS] = {}
        for user in ("watcher", *(f"agent-{h}" for h in HOSTS), "audit"):
            async def on_error(exc: Exception, who: str = user) -> None:
                if "permissions violation" in str(exc).lower():
                    self.tally.refused_by_permissions += 1

            url, password = _identity(stack, user)
            out[user] = await nats.connect(url, user=user if password else None, password=password,
                                           error_cb=on_error, allow_reconnect=False, name=f"hostile-{user}")
        return out

    async def _publish_batch(self, stack: LocalStack, conns: dict[str, nats.NATS], rng: random.Random,
                             live: dict[str, tuple[str, str, str, int]]) -> None:
        subjects = stack.subjects
        for _ in range(max(1, MESSAGES_PER_BATCH // 20)):
            lie_key, vm_host, messages = _hostile_messages(rng, live)
            other_host = next(h for h in HOSTS if h != vm_host)
            for kind, payload in messages:
                if kind in AUTHORISED_LIES:
                    liar = other_host if kind.startswith("wrong_host") else vm_host
                    with contextlib.suppress(nats.errors.Error, TimeoutError):
                        await conns[f"agent-{liar}"].publish(subjects.host_report(Key.parse(lie_key), liar), payload)
                    self.tally.sent(kind, f"agent-{liar}")
                users = sorted(conns)
                if kind in HOST_EVIDENCE_KINDS:
                    users = [u for u in users if u != f"agent-{vm_host}"]
                user = rng.choice(users)
                key = Key.parse(rng.choice(sorted(live)))
                host = user.removeprefix("agent-") if user.startswith("agent-") else rng.choice(HOSTS)
                targets = [subjects.report(key), subjects.host_report(key, host), subjects.observation(key)]
                if rng.random() < 0.3:  # what no identity here may publish: commands and the log
                    targets = [subjects.command(rng.choice(HOSTS)), subjects.log(key)]
                subject = rng.choice(targets)
                with contextlib.suppress(nats.errors.Error, TimeoutError):
                    await conns[user].publish(subject, payload[: 900 * 1024])
                self.tally.sent(kind, user)
        for conn in conns.values():
            with contextlib.suppress(nats.errors.Error, TimeoutError):
                await conn.flush(timeout=5)

    async def _hostile_pods(self, core: client.CoreV1Api, rng: random.Random, batch: int) -> list[str]:
        names = []
        for i in range(HOSTILE_PODS_PER_BATCH):
            name = _hostile_name(rng, batch * 10 + i)
            ann = dict(rng.choice(HOSTILE_ANNOTATIONS))
            try:
                await core.create_namespaced_pod(NS, _pod(name, ann))
                names.append(name)
                self.tally.hostile_pods += 1
            except ApiException as exc:  # the API refusing a hostile object is fine too
                self.tally.sent(f"api_refused_{exc.status}", "user")
        return names

    async def _running(self, core: client.CoreV1Api, name: str, within_s: float) -> bool:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            with contextlib.suppress(ApiException):
                p = await core.read_namespaced_pod(name, NS)
                if p.status is not None and p.status.phase == "Running" and (p.metadata.annotations or {}).get(
                        "vmfence.io/vm-id"):
                    return True
            await asyncio.sleep(0.2)  # no watch here: the API server is polled, bounded
        return False

    async def _steady(self, core: client.CoreV1Api) -> dict[str, tuple[str, str, str, int]]:
        """Each steady pod's (uid, host, vm id, epoch) from its annotations; a pod that lost its
        binding (or itself) shows as ("", "", "", 0) — the caller counts that as a VM change."""
        out = {}
        for i in range(STEADY):
            try:
                p = await core.read_namespaced_pod(f"steady-{i}", NS)
            except ApiException:
                out[f"{NS}/steady-{i}"] = ("", "", "", 0)
                continue
            ann = p.metadata.annotations or {}
            out[f"{NS}/steady-{i}"] = (p.metadata.uid, ann.get("vmfence.io/host", ""), ann.get("vmfence.io/vm-id", ""),
                                       int(ann.get("vmfence.io/epoch") or 0))
        return out

    async def _steady_vms(self, stack: LocalStack) -> dict[str, frozenset[str]]:
        """The VMs the hosts' runtimes really run for each steady pod (not its annotations, which a
        rebuild rewrites: a host's agent may legitimately claim evidence of a lost log tail, and the
        rebuild that follows re-adopts the same VM)."""
        by_key: dict[str, set[str]] = {f"{NS}/steady-{i}": set() for i in range(STEADY)}
        for vm_id, key in (await self._vm_owners(stack)).items():
            if key in by_key:
                by_key[key].add(vm_id)
        return {k: frozenset(v) for k, v in by_key.items()}

    async def _vm_owners(self, stack: LocalStack) -> dict[str, str]:
        owners = {}
        for agent in stack.agents.values():
            for info in await agent.driver.list():
                if info.state in ("running", "paused", "creating"):
                    owners[info.vm_id] = info.labels.get("vmfence.io/key", "?")
        return owners

    def _check_alive(self, stack: LocalStack) -> None:
        for name, rp in stack.recs.items():
            if rp.proc is not None and rp.proc.poll() is not None:
                self.tally.crashes.append(f"reconciler {name} exited {rp.proc.returncode}")
        for host, task in stack._agent_tasks.items():
            if task.done():
                self.tally.crashes.append(f"agent {host} ended: {task.exception()!r}")
        for task in stack._tasks:
            if task.done():
                self.tally.crashes.append(f"{task.get_name()} ended")

    async def run_seed(self, seed: int) -> dict[str, Any]:
        rng = random.Random(seed)
        stack = LocalStack(self.root / f"seed-{seed}", runtime="sim", partitions=4, restart_backoff_s=0.2,
                           host_stale_s=3.0)
        await stack.start()
        try:
            assert stack.api is not None
            core = client.CoreV1Api(stack.api)
            for i in range(STEADY):
                await core.create_namespaced_pod(NS, _pod(f"steady-{i}"))
            for i in range(STEADY):
                if not await self._running(core, f"steady-{i}", PROBE_BOUND_S):
                    raise RuntimeError(f"seed {seed}: steady-{i} never ran (before any hostile input)")
            live = await self._steady(core)
            legit = {f"{NS}/steady-{i}" for i in range(STEADY)}
            conns = await self._identities(stack)
            try:
                for batch in range(3):
                    before = await self._steady_vms(stack)
                    await self._publish_batch(stack, conns, rng, live)
                    for name in await self._hostile_pods(core, rng, batch):
                        legit.add(f"{NS}/{name}")
                    probe = f"probe-{seed}-{batch}"
                    await core.create_namespaced_pod(NS, _pod(probe))
                    legit.add(f"{NS}/{probe}")
                    self.tally.probes += 1
                    if not await self._running(core, probe, PROBE_BOUND_S):
                        self.tally.wedged_keys.append(f"{NS}/{probe}")
                    after = await self._steady_vms(stack)
                    for k in before:
                        if before[k] != after.get(k):
                            self.tally.vm_changes.append(
                                f"seed {seed}: {k}'s VMs {sorted(before[k])} -> {sorted(after.get(k, ()))}")
                    for vm_id, key in (await self._vm_owners(stack)).items():
                        if key not in legit:
                            self.tally.vm_changes.append(f"seed {seed}: VM {vm_id} for {key}, which nobody created")
                    self._check_alive(stack)
                    self.progress(f"seed {seed} batch {batch}: probe "
                                  f"{'ran' if f'{NS}/{probe}' not in self.tally.wedged_keys else 'WEDGED'}")
            finally:
                for conn in conns.values():
                    with contextlib.suppress(Exception):
                        await conn.close()
            return await self._end_checks(stack, seed)
        finally:
            await stack.stop()

    async def _end_checks(self, stack: LocalStack, seed: int) -> dict[str, Any]:
        from services.cli.verify import look, persistent

        assert stack.bus is not None
        await asyncio.sleep(1.0)  # a moment for in-flight hostile pods' first decisions; verify looks twice anyway
        first = await look(stack.bus, stack.kubeconfig_path, stuck_after_s=SETTLE_S)
        await asyncio.sleep(2.0)
        report = persistent(first, await look(stack.bus, stack.kubeconfig_path, stuck_after_s=SETTLE_S))
        records = [r async for r in read_log(stack.bus.js, stack.bus.subjects)]
        audit = audit_records(records, final=False)
        skipped: Counter[str] = Counter()
        for r in records:
            for d in r.entry.decisions:
                if isinstance(d, Skipped):
                    skipped[d.reason] += 1
        dlq = await stack.bus.js.stream_info(stack.subjects.stream_dlq)
        return {
            "seed": seed,
            "drift": [msgspec.to_builtins(d) for d in report.drift],
            "violations": [f"{v.rule} {v.key}#{v.n}: {v.message}" for v in audit.violations],
            "skipped": dict(skipped),
            "dead_lettered": int(dlq.state.messages or 0),
        }


async def run_hostile_campaign(seeds: int, first: int, *, root: str,
                               progress: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    campaign = HostileCampaign(Path(root), seeds, first, progress)
    started = time.monotonic()
    per_seed = [await campaign.run_seed(s) for s in range(first, first + seeds)]
    t = campaign.tally
    skipped: Counter[str] = Counter()
    for r in per_seed:
        skipped.update(r["skipped"])
    drift = [d for r in per_seed for d in r["drift"]]
    violations = [v for r in per_seed for v in r["violations"]]
    result = {
        "seeds": seeds,
        "first": first,
        "messages": {kind: dict(by) for kind, by in sorted(t.messages.items())},
        "messages_total": sum(sum(by.values()) for by in t.messages.values()),
        "hostile_pods": t.hostile_pods,
        "probes": t.probes,
        "refused_by_permissions": t.refused_by_permissions,
        "dead_lettered": sum(r["dead_lettered"] for r in per_seed),
        "skipped": dict(skipped),
        "wedged_keys": len(t.wedged_keys),
        "wedged": t.wedged_keys,
        "crashes": len(t.crashes),
        "crash_details": t.crashes,
        "vm_changes": t.vm_changes,
        "drift": drift,
        "violations": violations,
        "seconds": round(time.monotonic() - started, 1),
    }
    result["ok"] = not (t.wedged_keys or t.crashes or t.vm_changes or drift or violations)
    return result
