"""`vmfence demo` and `vmfence up`.

The demo starts a local stack, creates pods, then plays the race scenarios vmfence exists for as a
live workload — same-name recreates during bring-up, a delete retried after a recreate, VM-gone
racing a recreate, stale reads switched on during churn, a hibernate/wake, a reconciler killed
with SIGKILL and restarted — while it checks from the agents' own runtime records, many times a
second, that no key ever has two VMs. It ends with the audit of the decision log and exits 0 only
if the audit is clean.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException
from rich.console import Console
from rich.table import Table

from services.testbed.natsserver import write_private
from services.testbed.stack import (
    OPERATOR_USER,
    LocalStack,
    StackConfigError,
    load_kubeconfig,
    pick_runtime,
    private_append,
    private_dir,
)
from shared.bus.connect import Bus
from shared.bus.logstream import audit_records, read_log
from shared.tasks import finish_shielded, interruptible, run_main

NS = "default"
SETTLE_TIMEOUT_S = 60.0
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports it
ORACLE_PERIOD_S = 0.05


# --------------------------------------------------------------------------------- the oracle


class Oracle:
    """Counts VMs per key from the runtimes' own records (never from vmfence's state)."""

    def __init__(self, stack: LocalStack) -> None:
        self.stack = stack
        self.max_per_key = 0
        self.worst: tuple[str, list[str]] | None = None
        self.samples = 0

    async def vms_by_key(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for agent in self.stack.agents.values():
            for info in await agent.driver.list():
                if info.state in ("running", "paused", "creating"):
                    key = info.labels.get("vmfence.io/key", "?")
                    out.setdefault(key, []).append(info.vm_id)
        return out

    async def run(self) -> None:
        while True:
            with contextlib.suppress(Exception):
                by_key = await self.vms_by_key()
                self.samples += 1
                for key, vms in by_key.items():
                    if len(vms) > self.max_per_key:
                        self.max_per_key, self.worst = len(vms), (key, vms)
            await asyncio.sleep(ORACLE_PERIOD_S)


# ------------------------------------------------------------------------------- the workload


def _pod(name: str, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": {"vmfence.io/managed": "true"}, "annotations": annotations or {}},
        "spec": {
            "containers": [{"name": "main", "image": "vmfence/firmware"}],
            "tolerations": [{"key": "vmfence.io/vm", "operator": "Exists", "effect": "NoSchedule"}],
        },
    }


class Workload:
    def __init__(self, stack: LocalStack, say: Any) -> None:
        assert stack.api is not None
        self.stack = stack
        self.core = client.CoreV1Api(stack.api)
        self.say = say
        self.live: set[str] = set()

    async def create(self, name: str, annotations: dict[str, str] | None = None) -> str:
        pod = await self.core.create_namespaced_pod(NS, _pod(name, annotations))
        self.live.add(name)
        return str(pod.metadata.uid)

    async def force_delete(self, name: str) -> None:
        with contextlib.suppress(ApiException):
            await self.core.delete_namespaced_pod(name, NS, grace_period_seconds=0)
        self.live.discard(name)

    async def graceful_delete(self, name: str, uid: str | None = None) -> int:
        body = {"preconditions": {"uid": uid}} if uid else None
        try:
            await self.core.delete_namespaced_pod(name, NS, body=body)
            self.live.discard(name)
            return 200
        except ApiException as exc:
            return int(exc.status)

    async def recreate(self, name: str, annotations: dict[str, str] | None = None) -> str:
        await self.force_delete(name)
        return await self.create(name, annotations)

    async def annotate(self, name: str, key: str, value: str) -> None:
        await self.core.patch_namespaced_pod(name, NS, {"metadata": {"annotations": {key: value}}})

    async def pods(self) -> dict[str, Any]:
        res = await self.core.list_namespaced_pod(NS)
        return {p.metadata.name: p for p in res.items}

    async def wait(self, what: str, check: Any, within_s: float = SETTLE_TIMEOUT_S) -> None:
        deadline = time.monotonic() + within_s
        while True:
            if await check():
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what}")
            await asyncio.sleep(0.1)

    @staticmethod
    def running_ready(p: Any) -> bool:
        conds = {c.type: c.status for c in (p.status.conditions or [])} if p.status else {}
        return p.status is not None and p.status.phase == "Running" and conds.get("Ready") == "True"

    async def all_settled(self) -> bool:
        pods = await self.pods()
        if set(pods) != self.live:
            return False  # a deletion still in progress, or a pod missing
        for p in pods.values():
            hibernating = (p.metadata.annotations or {}).get("vmfence.io/hibernate") == "true"
            if p.metadata.deletion_timestamp is not None:
                return False
            if hibernating:
                conds = {c.type: c.status for c in (p.status.conditions or [])} if p.status else {}
                if conds.get("vmfence.io/Hibernated") != "True":
                    return False
            elif not self.running_ready(p):
                return False
        return True

    async def lose_vm_of(self, name: str) -> bool:
        """Make the runtime forget a pod's VM behind vmfence's back (a host losing it)."""
        key = f"{NS}/{name}"
        for agent in self.stack.agents.values():
            driver = agent.driver
            for info in await driver.list():
                if info.labels.get("vmfence.io/key") == key:
                    if hasattr(driver, "lose_vm"):
                        driver.lose_vm(info.vm_id)
                    else:
                        shutil.rmtree(driver.vm_dir(info.vm_id), ignore_errors=True)  # type: ignore[attr-defined]
                    return True
        return False

    async def play(self, steady: int) -> dict[str, int]:
        counts: Counter[str] = Counter()
        say = self.say
        say("creating pods")
        for i in range(steady):
            await self.create(f"web-{i}.demo")
        await self.wait("pods Running and Ready", self.all_settled)

        say("same-name recreate during bring-up")
        await self.create("race-bringup")
        await self.recreate("race-bringup")
        await self.recreate("race-bringup")
        counts["recreates"] += 2
        await self.wait("recreated pod Running", self.all_settled)

        say("a delete retried after a recreate")
        uid1 = await self.create("race-delete")
        await self.wait("race-delete Running", self.all_settled)
        await self.graceful_delete("race-delete")  # uid1 now terminating
        self.live.add("race-delete")
        await self.recreate("race-delete")  # force it away and take the name
        status = await self.graceful_delete("race-delete", uid=uid1)  # the retry still names uid1
        self.live.add("race-delete")
        counts["stale_delete_refused"] += int(status == 409)
        await self.wait("successor survives the retried delete", self.all_settled)

        say("VM-gone racing a recreate")
        await self.create("race-gone")
        await self.wait("race-gone Running", self.all_settled)
        await self.lose_vm_of("race-gone")
        await self.recreate("race-gone")
        await self.wait("successor not evicted", self.all_settled)

        say("stale reads on, churn, and a reconciler killed with SIGKILL")
        assert self.stack.apiserver is not None or True
        if self.stack.apiserver is not None:
            self.stack.apiserver.faults.set_stale(events=4)
        for round_ in range(4):
            for j in range(3):
                name = f"churn-{j}"
                if round_ == 0:
                    await self.create(name)
                elif round_ == 3 and j == 0:
                    await self.force_delete(name)
                else:
                    await self.recreate(name)
                    counts["recreates"] += 1
            if round_ == 1:
                victim = next(iter(self.stack.recs))
                self.stack.kill_reconciler(victim)
                counts["reconciler_kills"] += 1
                await asyncio.sleep(0.5)
                self.stack.start_reconciler(victim)
        if self.stack.apiserver is not None:
            self.stack.apiserver.faults.set_stale(events=0)
        await self.stack.wait_reconciler_ready(next(iter(self.stack.recs)))
        await self.wait("churn settled", self.all_settled, within_s=90)

        say("hibernate and wake")
        await self.annotate("web-0.demo", "vmfence.io/hibernate", "true")
        await self.wait("hibernated", self.all_settled)
        await self.annotate("web-0.demo", "vmfence.io/hibernate", "false")
        await self.wait("woken", self.all_settled)
        counts["hibernate_wake"] += 1

        say("deleting the race pods")
        for name in [n for n in self.live if not n.startswith("web-")]:
            await self.graceful_delete(name)
        await self.wait("deletions finished", self.all_settled)
        return dict(counts)


async def _log_settled(bus: Bus) -> None:
    """Quiescence of the log: no consumer lag and no new entry for a second."""
    js, subjects = bus.js, bus.subjects
    last, quiet_since = -1, time.monotonic()
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while time.monotonic() < deadline:
        info = await js.stream_info(subjects.stream_log)
        lag = 0
        for p in range(subjects.partitions):
            with contextlib.suppress(Exception):
                ci = await js.consumer_info(subjects.stream_in, f"reconciler-p{p}")
                lag += (ci.num_pending or 0) + (ci.num_ack_pending or 0)
        if info.state.last_seq != last or lag:
            last, quiet_since = info.state.last_seq, time.monotonic()
        elif time.monotonic() - quiet_since > 1.5:
            return
        await asyncio.sleep(0.2)


def _quiet_service_logs(path: Path) -> None:
    """The in-process services log to a file; the terminal is for the demo's own story."""
    import logging

    from shared.logs import JsonFormatter

    private_dir(path.parent)  # the services' log names pods, hosts and VMs: its user's only
    os.close(private_append(path))
    handler = logging.FileHandler(path)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    logging.getLogger("qemu.qmp").setLevel(logging.CRITICAL)  # it logs expected EOFs as errors


async def demo(args: argparse.Namespace) -> dict[str, Any]:
    runtime = pick_runtime(args.runtime)
    console = Console(stderr=True, quiet=args.json)
    stack = LocalStack(Path(args.dir), runtime=runtime, partitions=8)
    stack.lock()  # StackBusy (one line) before anything of another stack's is touched
    _quiet_service_logs(Path(args.dir).parent / f"{Path(args.dir).name}-logs" / "services.log")
    started = time.perf_counter()
    console.print(f"[bold]vmfence demo[/bold] — runtime [cyan]{runtime}[/cyan]"
                  + (" (firmware-only VMs)" if runtime == "qemu" else ""))
    phases: list[tuple[float, str]] = []

    def say(text: str) -> None:
        phases.append((time.perf_counter() - started, text))
        console.print(f"[dim]{time.perf_counter() - started:6.1f}s[/dim] {text}")

    result: dict[str, Any] = {}
    try:
        with console.status("starting the stack") as status:
            await stack.start(on_status=lambda name, state: status.update(f"{name}: {state}"))
        say("stack up: nats, apiserver, watcher, 2 reconcilers, agents host-a and host-b")
        oracle = Oracle(stack)
        oracle_task = asyncio.create_task(oracle.run())
        work = Workload(stack, say)
        try:
            counts = await work.play(args.pods)
        finally:
            oracle_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await oracle_task
        audit = await stack.open_bus(OPERATOR_USER, "vmfence-demo-audit")  # the audit reads as an operator would
        try:
            say("waiting for the log to settle")
            await _log_settled(audit)
            records = [r async for r in read_log(audit.js, audit.subjects)]
        finally:
            await audit.close()
        report = audit_records(records)
        vms_running = sum(len(v) for v in (await oracle.vms_by_key()).values())
        pods = len(await work.pods())
        violations = [f"{v.rule}: {v.key} entry {v.n}: {v.message}" for v in report.violations]
        if oracle.max_per_key > 1 and oracle.worst is not None:
            violations.append(f"runtime oracle: {oracle.worst[0]} had {oracle.max_per_key} VMs at once")
        result = {
            "runtime": runtime,
            "pods": pods,
            "vms_created": report.vms_created,
            "vms_removed": report.vms_released,
            "vms_running": vms_running,
            "decisions": report.decisions,
            "entries": report.entries,
            "skipped": report.skipped,
            "violations": violations,
            "max_vms_per_key": oracle.max_per_key,
            "oracle_samples": oracle.samples,
            "scenarios": counts,
            "reconciler_kills": sum(r.kills for r in stack.recs.values()),
            "seconds": round(time.perf_counter() - started, 1),
        }
    finally:
        with console.status("stopping the stack (removing its VMs)"):
            await finish_shielded(stack.stop())  # a second Ctrl-C does not leave VMs behind
    return result


def _table(result: dict[str, Any]) -> Table:
    t = Table(title="vmfence demo", show_header=False)
    for k in ("runtime", "pods", "vms_created", "vms_removed", "vms_running", "decisions", "max_vms_per_key",
              "reconciler_kills", "seconds"):
        t.add_row(k.replace("_", " "), str(result[k]))
    for reason, n in sorted(result["skipped"].items()):
        t.add_row(f"skipped: {reason}", str(n))
    bad = len(result["violations"])
    t.add_row("audit", "[green]clean[/green]" if not bad else f"[red]{bad} violations[/red]")
    return t


def one_line(exc: BaseException) -> str:
    """An ordinary failure as the one line the user sees (a log tail, if any, is in the files)."""
    text = str(exc).strip()
    if isinstance(exc, OSError) and exc.filename is not None:
        text = f"{exc.filename}: {exc.strerror or text}"
    return (text.splitlines() or [type(exc).__name__])[0]


def run_demo(args: argparse.Namespace) -> int:
    try:
        result = run_main(interruptible(demo(args)))
    except (TimeoutError, RuntimeError, OSError) as exc:  # StackBusy, StackConfigError, NatsServerError …
        print(f"vmfence demo: {one_line(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # the stack was stopped on the way out (demo's finally)
        print("vmfence demo: interrupted; the stack was stopped", file=sys.stderr)
        return EXIT_INTERRUPTED
    if args.json:
        sys.stdout.write(json.dumps(result) + "\n")
    else:
        Console().print(_table(result))
        for v in result["violations"]:
            Console().print(f"[red]VIOLATION[/red] {v}")
    return 0 if not result["violations"] else 1


# ------------------------------------------------------------------------------------ up


async def up(args: argparse.Namespace) -> int:
    runtime = pick_runtime(args.runtime)
    console = Console()
    if args.kubeconfig is not None:
        await load_kubeconfig(args.kubeconfig)  # an ordinary mistake, found before anything is made
    if getattr(args, "control_plane", "dev") == "kube":
        from services.testbed.kubecp import binaries

        if args.kubeconfig is not None:
            raise StackConfigError("--kubeconfig names a cluster; --control-plane kube starts one: give one of them")
        binaries()  # KubeUnavailable (one line: not built, or why the build failed) before anything starts
    # host_cpus/host_memory_mib 0: each agent offers its host's real CPUs and memory (minus the
    # agent's reserve), so the virtual Nodes kubectl shows have the capacity this machine has
    stack = LocalStack(Path(args.dir), runtime=runtime, partitions=16, kubeconfig=args.kubeconfig,
                       control_plane=getattr(args, "control_plane", "dev"), host_cpus=0, host_memory_mib=0)
    stack.lock()  # StackBusy (one line) before anything of another stack's is touched
    _quiet_service_logs(Path(args.dir).parent / f"{Path(args.dir).name}-logs" / "services.log")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    recorded = False
    try:
        await stack.start(on_status=lambda name, state: console.print(f"  {name:<14} {state}"))
        stack.record()
        recorded = True
        out = Path(os.getcwd(), args.kubeconfig_out)
        if args.kubeconfig is None:
            _copy_file(stack.kubeconfig_path, out)
        if stack.kube is not None:
            console.print(f"control plane: {stack.kube.url} (etcd, kube-apiserver, kube-scheduler, "
                          f"kube-controller-manager; logs in {stack.kube.directory / 'logs'}); "
                          "vmfence's services run as the chart's service accounts")
        console.print(f"vmfence is up (runtime {runtime}). kubeconfig: {out}")
        console.print(f"  kubectl --kubeconfig {args.kubeconfig_out} get pods -w")
        console.print("  virtual nodes: " + ", ".join(f"vmfence-{h}" for h in stack.hosts))
        console.print(f"  vmfence decisions / replay / status / verify log in as {OPERATOR_USER!r} "
                      "through .vmfence/stack.json (0600)")
        console.print("Ctrl-C stops everything and removes the VMs this stack created.")
        await stop.wait()
    finally:
        if stack.nats is not None:  # something was started
            console.print("stopping…")
        await stack.stop()
        if recorded:  # never another stack's record
            with contextlib.suppress(FileNotFoundError):
                os.remove(".vmfence/stack.json")
    return 0


def _copy_file(src: str, dest: Path) -> None:
    """A copy only its owner may read (a kubeconfig)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    write_private(dest, Path(src).read_text())


def run_up(args: argparse.Namespace) -> int:
    try:
        return int(run_main(up(args)))
    except (TimeoutError, RuntimeError, OSError) as exc:  # StackBusy, StackConfigError, NatsServerError …
        print(f"vmfence up: {one_line(exc)}", file=sys.stderr)
        return 1
