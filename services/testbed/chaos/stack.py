"""`vmfence chaos --stack --seeds N`: the seeded campaign against the real in-process components.

One seed determines the workload, the fault schedule and the bus weather: same-name recreates,
deletes, hibernate/wake of pods, a VirtualMachine whose VM is killed while its status write meets a
409, with faults injected where the real components meet the world — the
development API server's lagging cache, injected 409s on status writes, lost responses on deletes,
dropped watches; the sim runtime crashing or losing VMs; a reconciler SIGKILLed and restarted; and
at the client boundary of every component (``busfaults``: each reconciler, agent and the watcher
reach nats-server through a wire proxy) lost and duplicated deliveries, lost acks, lost publish
answers, publishes replayed after the (2 s) dedupe window, connection resets, a component cut off
from the bus for a while, and per-frame jitter that moves the components' relative order. The
interleaving is driven by the seed, not fixed by it: the components are real processes and tasks
that the OS schedules, so a failing seed is rerun with the same command but may not fail again.

All seeds share one stack (embedded NATS, API server, watcher, two reconciler processes, two sim
agents); each seed uses its own pod names. Oracles: the agents' runtime records sampled every 20 ms
(never two VMs for one key); after each seed's faults stop, every live pod Running with exactly one
VM owned by it, no VM for a deleted pod, the VirtualMachine Running on the one VM its status names
and, once deleted, without a VM; at the end, every input decided (the log's incarnation of
each live pod, every dead one ended) and the audit of the whole log.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from services.agent.runtime.base import VMInfo
from services.testbed.chaos.busfaults import CALM, BusProxy, Weather
from services.testbed.chaos.oracles import LIVE_STATES, lost_inputs
from services.testbed.stack import LocalStack
from shared.bus.logstream import Filter, audit_records, read_log
from shared.bus.provision import StreamsConfig
from shared.logs import JsonFormatter

NS = "default"
GROUP, VERSION, VMS = "vmfence.io", "v1alpha1", "virtualmachines"
SETTLE_S = 60.0
PARTITIONS = 4
DEDUPE_WINDOW_S = 2.0  # short, so that the proxies' late replays land after it (fault 22)
ACK_WAIT_S = 2.0  # lost deliveries and acks come back within a seed
CUT_S = (0.5, 2.0, 7.0)  # the last is longer than the lease TTL (3 s) and the host staleness (5 s)
STORM_TAIL_S = 2.0  # the bus weather lasts this long after the last step: the stack is busiest then


class _Oracle:
    def __init__(self, stack: LocalStack) -> None:
        self.stack = stack
        self.max_per_key = 0
        self.worst: tuple[str, list[str]] | None = None

    async def run(self) -> None:
        while True:
            with contextlib.suppress(Exception):
                for key, vms in (await _live_vms(self.stack)).items():
                    ids = [v.vm_id for v in vms]
                    if len(ids) > self.max_per_key:
                        self.max_per_key, self.worst = len(ids), (key, ids)
            await asyncio.sleep(0.02)


def _vm(name: str) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "VirtualMachine", "metadata": {"name": name},
        "spec": {"cpus": 1, "memory": "128Mi", "restartPolicy": "Always"},
    }


async def _kill_vm(stack: LocalStack, key: str) -> bool:
    """Crash the running VM of ``key`` at its sim runtime; False if it has none running now."""
    for agent in list(stack.agents.values()):
        for info in await agent.driver.list():
            if info.labels.get("vmfence.io/key") == key and info.state == "running":
                agent.driver.crash_vm(info.vm_id, exit_code=1)  # type: ignore[attr-defined]
                return True
    return False


def _pod(name: str, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": {"vmfence.io/managed": "true"}, "annotations": annotations or {}},
        "spec": {"containers": [{"name": "main", "image": "vm"}]},
    }


async def _seed(
    stack: LocalStack, core: client.CoreV1Api, proxies: dict[str, BusProxy], seed: int, steps: int,
    faults: dict[str, int],
) -> str | None:
    rng = random.Random(seed)
    weather = random.Random(f"weather/{seed}")
    for proxy in proxies.values():
        proxy.set_weather(seed, Weather.draw(weather))
    names = [f"s{seed}-p{i}.x" for i in range(3)]
    live: dict[str, bool] = {}  # name -> hibernate wanted
    api = stack.apiserver
    assert api is not None

    def hit(kind: str) -> None:
        faults[kind] = faults.get(kind, 0) + 1

    custom = client.CustomObjectsApi(stack.api)
    vm_name = f"s{seed}-vm"
    await custom.create_namespaced_custom_object(GROUP, VERSION, NS, VMS, _vm(vm_name))
    for _ in range(steps):
        name = rng.choice(names)
        roll = rng.random()
        with contextlib.suppress(ApiException):
            if roll < 0.25 or name not in live:
                if name in live:
                    await core.delete_namespaced_pod(name, NS, grace_period_seconds=0)
                    hit("recreate")
                ann = {"vmfence.io/on-recreate": rng.choice(["replace", "adopt"])}
                await core.create_namespaced_pod(NS, _pod(name, ann))
                live[name] = False
            elif roll < 0.35:
                await core.delete_namespaced_pod(name, NS)
                live.pop(name, None)
                hit("delete")
            elif roll < 0.45:
                want = not live[name]
                await core.patch_namespaced_pod(
                    name, NS, {"metadata": {"annotations": {"vmfence.io/hibernate": str(want).lower()}}}
                )
                live[name] = want
                hit("hibernate" if want else "wake")
            elif roll < 0.55:
                api.faults.set_stale(events=rng.randrange(1, 6))
                hit("stale_reads")
            elif roll < 0.62:
                api.faults.inject_error("patch", "pods/status", 409, count=rng.randrange(1, 3))
                hit("conflict_on_status")
            elif roll < 0.67:
                api.faults.lose_response("delete", "pods", count=1)
                hit("delete_response_lost")
            elif roll < 0.72:
                api.faults.drop_watches()
                hit("watch_dropped")
            elif roll < 0.82:
                agent = stack.agents[rng.choice(sorted(stack.agents))]
                vms = [v for v in await agent.driver.list() if v.labels.get("vmfence.io/key") == f"{NS}/{name}"]
                if vms and vms[0].state == "running":
                    if rng.random() < 0.5:
                        agent.driver.crash_vm(vms[0].vm_id, exit_code=1)  # type: ignore[attr-defined]
                        hit("vm_crash")
                    else:
                        agent.driver.lose_vm(vms[0].vm_id)  # type: ignore[attr-defined]
                        await agent.driver.reconcile()  # type: ignore[attr-defined]
                        hit("vm_lost")
            elif roll < 0.86:
                victim = rng.choice(sorted(stack.recs))
                stack.kill_reconciler(victim)
                stack.start_reconciler(victim)
                hit("reconciler_sigkill")
            elif roll < 0.89:
                proxies[rng.choice(sorted(proxies))].cut(rng.choice(CUT_S))
            elif roll < 0.93 and await _kill_vm(stack, f"vm:{NS}/{vm_name}"):
                api.faults.inject_error("patch", "virtualmachines/status", 409, count=rng.randrange(1, 3))
                hit("vm_killed_while_status_conflicts")
            await asyncio.sleep(rng.random() * 0.05)
    await asyncio.sleep(STORM_TAIL_S)  # the stack works through the seed's churn under the weather
    api.faults.set_stale(events=0)
    for proxy in proxies.values():
        proxy.set_weather(seed, CALM)
    # quiescence for this seed's pods: each live pod Running/hibernated with its VM, none for the dead
    for name in list(stack.recs):
        await stack.wait_reconciler_ready(name)
    deadline = time.monotonic() + SETTLE_S
    deleted = False
    while True:
        problem = await _check(stack, core, names) or await _check_vm(stack, custom, vm_name, deleted)
        if problem is None and not deleted:  # then the VirtualMachine goes, and its VM with it
            await custom.delete_namespaced_custom_object(GROUP, VERSION, NS, VMS, vm_name)
            deleted, problem = True, "deleting the VirtualMachine"
        if problem is None:
            return None
        if time.monotonic() > deadline:
            return problem
        await asyncio.sleep(0.2)


async def _live_vms(stack: LocalStack) -> dict[str, list[VMInfo]]:
    """The agents' runtime records of VMs that count as a VM (running, paused, creating), by key."""
    out: dict[str, list[VMInfo]] = {}
    for agent in list(stack.agents.values()):
        for info in await agent.driver.list():
            if info.state in LIVE_STATES:
                out.setdefault(info.labels.get("vmfence.io/key", "?"), []).append(info)
    return out


async def _check(stack: LocalStack, core: client.CoreV1Api, names: list[str]) -> str | None:
    vms = await _live_vms(stack)
    for name in names:
        key = f"{NS}/{name}"
        try:
            pod = await core.read_namespaced_pod(name, NS)
        except ApiException as exc:
            if exc.status != 404:
                raise
            pod = None
        have = vms.get(key, [])
        if pod is None:
            if have:
                return f"{key}: {len(have)} VM(s) for a deleted pod"
            continue
        if pod.metadata.deletion_timestamp is not None:
            return f"{key}: still terminating"
        hib = (pod.metadata.annotations or {}).get("vmfence.io/hibernate") == "true"
        conds = {c.type: c.status for c in (pod.status.conditions or [])} if pod.status else {}
        if hib:
            if have or conds.get("vmfence.io/Hibernated") != "True":
                return f"{key}: not hibernated ({len(have)} VMs)"
            continue
        if len(have) != 1 or conds.get("Ready") != "True":
            return f"{key}: {len(have)} VM(s), Ready={conds.get('Ready')}"
        if have[0].labels.get("vmfence.io/uid") != pod.metadata.uid and pod.metadata.annotations.get(
            "vmfence.io/on-recreate"
        ) != "adopt":
            return f"{key}: VM {have[0].vm_id} was made for another incarnation"
    return None


async def _check_vm(stack: LocalStack, custom: client.CustomObjectsApi, name: str, deleted: bool) -> str | None:
    key = f"vm:{NS}/{name}"
    have = (await _live_vms(stack)).get(key, [])
    if deleted:
        if have:
            return f"{key}: {len(have)} VM(s) for a deleted VirtualMachine"
        assert stack.bus is not None
        records = [r async for r in read_log(stack.bus.js, stack.bus.subjects, Filter(key=key))]
        unsettled = lost_inputs(records, {})
        return f"{key}: the deletion is not decided yet ({unsettled[0]})" if unsettled else None
    obj = await custom.get_namespaced_custom_object(GROUP, VERSION, NS, VMS, name)
    st = obj.get("status") or {}
    ready = {c["type"]: c["status"] for c in st.get("conditions", [])}.get("Ready")
    if st.get("phase") != "Running" or ready != "True" or len(have) != 1 or st.get("vmID") != have[0].vm_id:
        return f"{key}: phase {st.get('phase')}, Ready={ready}, vmID {st.get('vmID')}, {len(have)} VM(s)"
    return None


async def _log_tail(stack: LocalStack, problem: str, n: int = 8) -> list[str]:
    """The key's last entries, to read a failure without a rerun (interleavings do not replay)."""
    from services.cli.decisions import describe

    assert stack.bus is not None
    key = problem.split(": ", 1)[0]
    entries = [r.entry async for r in read_log(stack.bus.js, stack.bus.subjects) if r.entry.key == key]
    lines = [f"#{e.n} " + ", ".join(describe(d) for d in e.decisions) for e in entries[-n:]]
    # what the watcher published for the key (uid:resourceVersion, g = gone), and the pod now
    from shared.bus.read import read_stream
    from shared.fence.keys import Key
    from shared.fence.schema import Observed, decode_input

    subject = stack.bus.subjects.observation(Key.parse(key))
    seen = []
    async for m in read_stream(stack.bus.js, stack.bus.subjects.stream_in, subject):
        o = decode_input(m.data)
        if isinstance(o, Observed):
            seen.append(f"{o.uid[:8]}:{o.resource_version}{'g' if o.gone else ''}{'d' if o.deleting else ''}")
    lines.append("observed: " + " ".join(seen[-12:]))
    return lines


async def run_stack_campaign(
    seeds: int, first: int = 0, steps: int = 25, root: str = ".vmfence/chaos-stack",
    progress: Callable[[str], None] = lambda line: None,
) -> dict[str, Any]:
    start = time.perf_counter()
    proxies: dict[str, BusProxy] = {}

    async def door(component: str, url: str) -> str:
        host, port = url.removeprefix("nats://").rsplit(":", 1)
        proxies[component] = BusProxy(component, (host, int(port)))
        return await proxies[component].start()

    stack = LocalStack(
        Path(root), runtime="sim", partitions=PARTITIONS, restart_backoff_s=0.2, host_stale_s=5.0,
        ack_wait_s=ACK_WAIT_S, streams=StreamsConfig(partitions=PARTITIONS, duplicate_window_s=DEDUPE_WINDOW_S),
        bus_door=door,
    )
    try:
        await stack.start()
    except BaseException:
        await _stop_proxies(proxies)
        raise
    # the in-process components (agents, watcher) log to a file a failure can be read from
    handler = logging.FileHandler(stack.root / "logs" / "in-process.log")
    handler.setFormatter(JsonFormatter())
    handler.setLevel(logging.INFO)
    loggers = [logging.getLogger(name) for name in ("services", "vmfence")]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.INFO)
    oracle = _Oracle(stack)
    watch = asyncio.create_task(oracle.run())
    faults: dict[str, int] = {}
    failures: list[dict[str, Any]] = []
    try:
        assert stack.api is not None
        core = client.CoreV1Api(stack.api)
        for seed in range(first, first + seeds):
            t0 = time.perf_counter()
            problem = await _seed(stack, core, proxies, seed, steps, faults)
            if problem is not None:
                failures.append({"seed": seed, "invariant": problem, "log_tail": await _log_tail(stack, problem),
                                 "replay": f"vmfence chaos --stack --seed {seed} --steps {steps}"})
            progress(f"seed {seed}: {problem or 'ok'} ({time.perf_counter() - t0:.1f}s, "
                     f"{len(failures)} failing so far, max {oracle.max_per_key} VM per key)")
        assert stack.bus is not None
        records = [r async for r in read_log(stack.bus.js, stack.bus.subjects)]
        report = audit_records(records, final=False)
        live = {
            f"{NS}/{p.metadata.name}": (str(p.metadata.uid),
                                         (p.metadata.annotations or {}).get("vmfence.io/hibernate") == "true")
            for p in (await core.list_namespaced_pod(NS)).items
        }
        vms = await client.CustomObjectsApi(stack.api).list_namespaced_custom_object(GROUP, VERSION, NS, VMS)
        live |= {f"vm:{NS}/{v['metadata']['name']}": (v["metadata"]["uid"], False) for v in vms["items"]}
        lost = lost_inputs(records, live)
    finally:
        watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch
        await stack.stop()
        await _stop_proxies(proxies)
        for lg in loggers:
            lg.removeHandler(handler)
        handler.close()
    for proxy in proxies.values():
        for kind, n in proxy.counts.items():
            faults[kind] = faults.get(kind, 0) + n
    if oracle.max_per_key > 1:
        failures.append({"seed": None, "invariant": f"two VMs for one key at once: {oracle.worst}"})
    return {
        "mode": "stack",
        "seeds": seeds,
        "failures": failures,
        "steps": seeds * steps,
        "faults_injected": dict(sorted(faults.items())),
        "max_vms_per_key": oracle.max_per_key,
        "lost_inputs": lost,
        "violations": [f"{v.rule} {v.key}#{v.n}: {v.message}" for v in report.violations],
        "decisions": report.decisions,
        "seconds": round(time.perf_counter() - start, 1),
    }


async def _stop_proxies(proxies: dict[str, BusProxy]) -> None:
    for proxy in proxies.values():
        await proxy.stop()
