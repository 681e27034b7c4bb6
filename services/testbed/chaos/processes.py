"""`vmfence chaos`: fault campaigns against vmfence.

``--processes`` runs the real thing: a 3-node nats-server cluster (R3 streams), the development API
server, a watcher, two reconcilers and two agents, each a separate OS process, while pods churn
(creates, same-name recreates, deletes, hibernate/wake) and a driver SIGKILLs a random component
every few seconds and starts it again — one nats-server node at a time included.

The oracle trusts nothing vmfence says about itself: it samples the operating system's process
table (every QEMU whose ``-pidfile`` lives under this run's directory; for the sim runtime, the sim
host state files the agents persist) and counts VMs per pod key and per incarnation. At the end the
faults stop, the system must quiesce, and the final VMs are compared with the live pods in the API
and with the decision log, whose audit must be clean.

``--seeds``/``--seed`` is the deterministic in-process campaign (``services.testbed.chaos.seeds``), kept
in a separate module and imported only when asked for.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import shutil
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from services.testbed.chaos.oracles import HOSTS, NS, Oracle, kill_leftover_qemu, qemu_pids_under
from services.testbed.chaos.proc import POLL_S, READY_TIMEOUT_S, Proc, cli, http_post_json, http_status
from shared.tasks import cancel_and_wait

PARTITIONS = 8
LEASE_TTL_S = 3.0
MIN_KILL_WAIT_S = 30.0  # the longest --min-kills stretches the chaos window, per kill asked for
QUIET_S = 5.0  # no new log entry for this long (with zero lag) = quiescent


# ------------------------------------------------------------------------------- the campaign


def _pod(name: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": {"vmfence.io/managed": "true", "vmfence.io/chaos": "true"}},
        "spec": {
            "containers": [{"name": "main", "image": "vmfence/firmware"}],
            "tolerations": [{"key": "vmfence.io/vm", "operator": "Exists", "effect": "NoSchedule"}],
        },
    }


@dataclass
class ProcessChaos:
    args: argparse.Namespace
    run_dir: Path = field(init=False)
    runtime: str = field(init=False)
    rng: random.Random = field(init=False)
    procs: dict[str, Proc] = field(default_factory=dict, init=False)
    kills: Counter[str] = field(default_factory=Counter, init=False)
    unexpected_exits: Counter[str] = field(default_factory=Counter, init=False)
    restart_timeouts: list[str] = field(default_factory=list, init=False)
    ops: Counter[str] = field(default_factory=Counter, init=False)
    notes: list[str] = field(default_factory=list, init=False)
    forced: set[tuple[str, str]] = field(default_factory=set, init=False)  # incarnations force-deleted
    layout_hosts: ClassVar[tuple[str, ...]] = HOSTS  # the stack's agents (the compose stack has three)
    layout_partitions: ClassVar[int] = PARTITIONS

    def __post_init__(self) -> None:
        from services.testbed.stack import pick_runtime

        self.run_dir = Path(self.args.dir).resolve()
        self.runtime = pick_runtime(self.args.runtime)
        seed = self.args.rng_seed if self.args.rng_seed is not None else random.SystemRandom().randrange(2**31)
        self.rng_seed = seed
        self.rng = random.Random(seed)
        self._stop_faults = asyncio.Event()
        self._enough_kills = asyncio.Event()  # --min-kills reached: the chaos window may close
        self._busy = asyncio.Lock()  # one component down at a time: the killer and the reviver take it

    def say(self, text: str) -> None:
        """Progress on stderr (stdout carries only the JSON)."""
        if not self.args.quiet:
            print(f"[chaos {time.monotonic() - self._t0:7.1f}s] {text}", file=sys.stderr, flush=True)

    # --------------------------------------------------------------------------- stack
    async def start_stack(self) -> None:
        from kubernetes_asyncio import client, config

        from services.testbed.natsserver import agent_user, free_port, local_accounts, start_cluster
        from services.testbed.stack import HARNESS_USER, USERS_FILE, DirLock, private_dir
        from shared.bus.connect import Bus
        from shared.bus.provision import StreamsConfig, provision
        from shared.kubeclient import api_client
        from shared.subjects import Subjects

        self.dir_lock = DirLock(self.run_dir)
        self.dir_lock.acquire()  # StackBusy before anything of another run's is touched
        self.dir_lock.clear_directory()
        logs = private_dir(self.run_dir / "logs")
        # the deployment's users and permissions (deploy/nats/accounts.conf), passwords of this run
        accounts, users = local_accounts(HOSTS)
        users.save(self.run_dir / USERS_FILE)
        self.cluster = await start_cluster(3, base_dir=str(private_dir(self.run_dir / "nats")), accounts=accounts,
                                           keep_fds=self.dir_lock.inherit)
        urls = ",".join(self.cluster.urls)
        self.subjects = Subjects(partitions=PARTITIONS)
        # the campaign's own connection is admin: it reads every consumer's lag and lists the streams
        self.bus = await Bus.open(self.cluster.urls, name="vmfence-chaos", subjects=self.subjects,
                                  auth=users.auth(HARNESS_USER))
        provisioner = await Bus.open(self.cluster.urls, name="vmfence-chaos-provision", subjects=self.subjects,
                                     auth=users.auth("reconciler"))
        try:
            await provision(
                provisioner.js, self.subjects,
                StreamsConfig(replicas=3, partitions=PARTITIONS, lease_ttl_s=LEASE_TTL_S),
            )
        finally:
            await provisioner.close()
        kubeconfig = str(self.run_dir / "kubeconfig")
        api_port = free_port()
        self.api_port = api_port
        self.procs["apiserver"] = Proc(
            "apiserver", "apiserver",
            cli("apiserver", "--port", str(api_port), "--db", str(self.run_dir / "api.sqlite"),
                 "--kubeconfig-out", kubeconfig),
            api_port, logs / "apiserver.log",
        )  # fmt: skip
        self.procs["apiserver"].keep_fds = self.dir_lock.inherit
        self.procs["apiserver"].start()
        if not await self.procs["apiserver"].wait_ready():
            raise RuntimeError(f"apiserver not ready:\n{self.procs['apiserver'].tail()}")
        await self._apply_api_faults()
        for host in HOSTS:
            port = free_port()
            argv = cli(
                "agent", "--nats-url", urls, "--host", host, "--runtime", self.runtime,
                "--data-dir", str(self.run_dir / "agents" / host), "--http-host", "127.0.0.1",
                "--http-port", str(port), "--partitions", str(PARTITIONS), "--cpus", "64",
                "--memory-mib", "65536", "--heartbeat-interval", "1", "--inventory-interval", "10",
                "--probe-interval", "1", "--vnc-range", "none", "--shutdown-timeout", "10",
                "--cleanup-on-stop", "--sim-seed", str(self.rng.randrange(2**31)),
            )  # fmt: skip
            self.procs[f"agent-{host}"] = Proc(f"agent-{host}", "agent", argv, port, logs / f"agent-{host}.log",
                                               env=users.env(agent_user(host)))
        port = free_port()
        self.procs["watcher"] = Proc(
            "watcher", "watcher",
            cli("watcher", "--nats-url", urls, "--kubeconfig", kubeconfig, "--partitions", str(PARTITIONS),
                 "--namespace", NS, "--http-host", "127.0.0.1", "--http-port", str(port)),
            port, logs / "watcher.log", env=users.env("watcher"),
        )  # fmt: skip
        for i in (1, 2):
            port = free_port()
            name = f"reconciler-{i}"
            self.procs[name] = Proc(
                name, "reconciler",
                cli("reconciler", "--nats-url", urls, "--kubeconfig", kubeconfig, "--id", name,
                     "--partitions", str(PARTITIONS), "--replicas", "3",
                     "--data-dir", str(self.run_dir / "reconcilers"), "--http-host", "127.0.0.1",
                     "--http-port", str(port), "--lease-ttl", str(int(LEASE_TTL_S)),
                     "--snapshot-interval", "0.5", "--restart-backoff", "1"),
                port, logs / f"{name}.log", env=users.env("reconciler"),
            )  # fmt: skip
        for p in self.procs.values():
            p.keep_fds = self.dir_lock.inherit
            if not p.running:
                p.start()
        for p in self.procs.values():
            if not await p.wait_ready():
                raise RuntimeError(f"{p.name} not ready within {READY_TIMEOUT_S:.0f}s:\n{p.tail()}")
        cfg = client.Configuration()
        await config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
        self.api = api_client(cfg)
        self.core = client.CoreV1Api(self.api)

    async def _apply_api_faults(self) -> None:
        if self.args.stale_reads and not self._stop_faults.is_set():
            await http_post_json(self.api_port, "/_dev/faults", {"stale": {"events": self.args.stale_reads}})

    async def stop_stack(self) -> dict[str, Any]:
        """Reverse order; agents get SIGTERM and remove their VMs (--cleanup-on-stop). A run that
        never got its directory's lock stops nothing: what runs there is another run's."""
        lock = getattr(self, "dir_lock", None)
        if lock is None or not lock.held:
            return {"qemu_left_after_agent_stop": 0, "qemu_killed_at_end": 0}
        for attr in ("api", "bus"):
            obj = getattr(self, attr, None)
            if obj is not None:
                with contextlib.suppress(Exception):
                    await obj.close()
        order = ["reconciler-1", "reconciler-2", "watcher", f"agent-{HOSTS[0]}", f"agent-{HOSTS[1]}", "apiserver"]
        await asyncio.gather(*(self.procs[n].stop() for n in order[:3] if n in self.procs))
        await asyncio.gather(*(self.procs[n].stop() for n in order[3:5] if n in self.procs))
        left_after_agents = len(qemu_pids_under(self.run_dir)) if self.runtime == "qemu" else 0
        for p in self.procs.values():
            await p.stop()
        cluster = getattr(self, "cluster", None)
        if cluster is not None:
            await cluster.stop()
        killed = kill_leftover_qemu(self.run_dir)
        lock.release()
        return {"qemu_left_after_agent_stop": left_after_agents, "qemu_killed_at_end": killed}

    # ---------------------------------------------------------------------------- faults
    def _components(self) -> list[str]:
        kinds = {"apiserver", "watcher", "reconciler", "agent", "nats"}
        if self.args.targets != "all":
            kinds = {k.strip() for k in self.args.targets.split(",")}
        names = [n for n, p in self.procs.items() if p.kind in kinds]
        if "nats" in kinds:
            names += [f"nats-{n.name}" for n in self.cluster.nodes]
        return names

    async def _kill_and_restart(self, victim: str) -> None:
        down_s = self.rng.uniform(0.5, 3.0)
        if victim.startswith("nats-"):
            node = next(n for n in self.cluster.nodes if f"nats-{n.name}" == victim)
            node.kill()
            self.kills["nats"] += 1
            self.say(f"SIGKILL {victim}; down {down_s:.1f}s")
            await asyncio.sleep(down_s)  # the outage itself, not synchronisation
            try:
                await node.restart()
                await self.cluster.wait_meta_leader()
                await self._wait_node_healthy(node)
            except Exception as exc:
                self.restart_timeouts.append(f"{victim}: {exc!s:.300}")
            return
        proc = self.procs[victim]
        proc.kill()
        self.kills[proc.kind] += 1
        self.say(f"SIGKILL {victim}; down {down_s:.1f}s")
        await asyncio.sleep(down_s)
        proc.start()
        if not await proc.wait_ready():
            how = f"exited with {proc.popen.returncode}" if proc.popen and proc.popen.poll() is not None else (
                f"not ready within {READY_TIMEOUT_S:.0f}s")
            self.restart_timeouts.append(f"{victim}: {how} after restart:\n{proc.tail(5)}")
        if victim == "apiserver":
            await self._apply_api_faults()  # faults are in-memory: a restart clears them

    async def _wait_node_healthy(self, node: Any) -> None:
        """A restarted node is caught up when its full /healthz (streams current) says so."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if await http_status(node.http_port, "/healthz") == 200:
                return
            await asyncio.sleep(POLL_S)
        raise TimeoutError(f"{node.name} /healthz not ok within {READY_TIMEOUT_S:.0f}s")

    async def killer(self) -> None:
        every = self.args.kill_every
        while not self._stop_faults.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop_faults.wait(), self.rng.uniform(0.5 * every, 1.5 * every))
            if self._stop_faults.is_set():
                return
            async with self._busy:
                await self._kill_and_restart(self.rng.choice(self._components()))
            if sum(self.kills.values()) >= self.args.min_kills:
                self._enough_kills.set()

    async def reviver(self) -> None:
        """A component that exits on its own is a finding: record it, keep the system whole."""
        while True:
            await asyncio.sleep(1.0)
            async with self._busy:
                for p in self.procs.values():
                    if p.popen is not None and p.popen.poll() is not None:
                        self.unexpected_exits[p.name] += 1
                        self.notes.append(f"{p.name} exited by itself with {p.popen.returncode}:\n{p.tail(8)}")
                        self.say(f"{p.name} exited by itself ({p.popen.returncode}); restarting")
                        p.start()
                        await p.wait_ready()
                for node in self.cluster.nodes:
                    if not node.running:
                        self.unexpected_exits[f"nats-{node.name}"] += 1
                        with contextlib.suppress(Exception):
                            await node.restart()

    # ----------------------------------------------------------------------------- churn
    async def churn(self) -> None:
        from kubernetes_asyncio.client.exceptions import ApiException

        names = [f"c-{i}" for i in range(self.args.pods)]
        hibernating: dict[str, bool] = {}
        every = self.args.churn_every
        while not self._stop_faults.is_set():
            name = self.rng.choice(names)
            try:
                pod = await self.core.read_namespaced_pod(name, NS)
            except ApiException as exc:
                pod = None if exc.status == 404 else False
            except Exception:
                pod = False
            try:
                if pod is False:
                    self.ops["api_unavailable"] += 1
                elif pod is None:
                    await self.core.create_namespaced_pod(NS, _pod(name))
                    hibernating[name] = False
                    self.ops["create"] += 1
                elif pod.metadata.deletion_timestamp is not None:
                    self.ops["skipped_terminating"] += 1
                else:
                    roll = self.rng.random()
                    if roll < 0.35:
                        self.forced.add((f"{NS}/{name}", str(pod.metadata.uid).replace("-", "")[:8]))
                        await self.core.delete_namespaced_pod(name, NS, grace_period_seconds=0)
                        await self.core.create_namespaced_pod(NS, _pod(name))
                        hibernating[name] = False
                        self.ops["recreate"] += 1
                    elif roll < 0.6:
                        await self.core.delete_namespaced_pod(name, NS)
                        self.ops["delete"] += 1
                    elif roll < 0.85:
                        value = not hibernating.get(name, False)
                        body = {"metadata": {"annotations": {"vmfence.io/hibernate": "true" if value else "false"}}}
                        await self.core.patch_namespaced_pod(name, NS, body)
                        hibernating[name] = value
                        self.ops["hibernate" if value else "wake"] += 1
            except ApiException as exc:
                self.ops[f"api_{exc.status}"] += 1
            except Exception:
                self.ops["api_unavailable"] += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop_faults.wait(), self.rng.uniform(0.3 * every, 1.7 * every))

    # ------------------------------------------------------------------------ quiescence
    async def _lag(self) -> int:
        js, s = self.bus.js, self.subjects
        lag = 0
        names = [(s.stream_in, f"reconciler-p{p}") for p in range(self.layout_partitions)]
        names += [(s.stream_cmd, f"agent-{h}") for h in self.layout_hosts]
        for stream, durable in names:
            try:
                ci = await js.consumer_info(stream, durable)
            except Exception:
                return -1
            lag += (ci.num_pending or 0) + (ci.num_ack_pending or 0)
        return lag

    async def settle(self, result: dict[str, Any], *, recheck_after_s: float) -> None:
        """Once the faults stopped: quiescence, then the verdict into ``result``; an end state with
        an orphan or a pod without its VM is checked again after ``recheck_after_s`` (an agent's
        periodic inventory may still collect an orphan: two rounds)."""
        self.say("faults stopped; waiting for quiescence")
        q0 = time.monotonic()
        quiesced, why = await self.quiesce(self.args.settle_timeout)
        result["quiesce_seconds"] = round(time.monotonic() - q0, 1)
        result["quiesced"] = quiesced
        if not quiesced:
            result["quiesce_state"] = why
        end = await self.verdict()
        if end["leaked_vms"] or end["pods_without_vm"]:
            self.say(f"end state not clean yet ({end['leaked']}, {end['pods_without_vm']}); re-checking")
            await asyncio.sleep(recheck_after_s)
            await self.quiesce(60.0)
            end = await self.verdict()
        result.update(end)

    async def _pods(self) -> dict[str, Any]:
        res = await self.core.list_namespaced_pod(NS)
        return {p.metadata.name: p for p in res.items}

    @staticmethod
    def _settled(p: Any) -> bool:
        if p.metadata.deletion_timestamp is not None or p.status is None:
            return False
        conds = {c.type: c.status for c in (p.status.conditions or [])}
        if (p.metadata.annotations or {}).get("vmfence.io/hibernate") == "true":
            return conds.get("vmfence.io/Hibernated") == "True"
        return p.status.phase == "Running" and conds.get("Ready") == "True"

    async def quiesce(self, within_s: float) -> tuple[bool, str]:
        """Zero lag, every pod settled, and no new log entry for QUIET_S seconds."""
        deadline = time.monotonic() + within_s
        last_seq, quiet_since, why = -1, time.monotonic(), "not checked"
        said = time.monotonic()
        while time.monotonic() < deadline:
            if time.monotonic() - said > 5.0:
                self.say(f"not quiet yet: {why}")
                said = time.monotonic()
            try:
                info = await self.bus.js.stream_info(self.subjects.stream_log)
                lag = await self._lag()
                pods = await self._pods()
            except Exception as exc:
                why = f"error: {exc!r:.200}"
                await asyncio.sleep(POLL_S)
                continue
            unsettled = sorted(n for n, p in pods.items() if not self._settled(p))
            seq = info.state.last_seq
            if seq != last_seq or lag != 0 or unsettled:
                why = f"log seq {seq}, lag {lag}, unsettled pods {unsettled}"
                last_seq, quiet_since = seq, time.monotonic()
            elif time.monotonic() - quiet_since >= QUIET_S:
                return True, "quiet"
            await asyncio.sleep(POLL_S)
        return False, why

    # ------------------------------------------------------------------------- the end
    async def verdict(self) -> dict[str, Any]:
        """Compare the OS's VMs with the live pods, and the log with both."""
        from services.testbed.chaos.oracles import lost_inputs
        from shared.bus.logstream import audit_records, read_log

        pods = await self._pods()
        live = {f"{NS}/{n}": (str(p.metadata.uid), p) for n, p in pods.items()}
        vms = await asyncio.to_thread(Oracle(self.run_dir, self.runtime).scan)
        leaked = [
            f"{vm.vm_id} on {vm.host} (key {vm.key}, uid {vm.uid8})"
            for vm in vms
            if vm.key not in live or live[vm.key][0].replace("-", "")[:8] != vm.uid8
        ]
        by_key = Counter(vm.key for vm in vms if vm.key in live)
        without_vm = sorted(
            k for k, (_uid, p) in live.items()
            if (p.metadata.annotations or {}).get("vmfence.io/hibernate") != "true" and by_key[k] != 1
        )  # fmt: skip
        records = [r async for r in read_log(self.bus.js, self.subjects)]
        report = audit_records(records)
        lost = lost_inputs(records, {
            k: (uid, (p.metadata.annotations or {}).get("vmfence.io/hibernate") == "true")
            for k, (uid, p) in live.items()
        })
        violations = [f"{v.rule}: {v.key} entry {v.n}: {v.message}" for v in report.violations]
        consumers: dict[str, int] = {}
        with contextlib.suppress(Exception):  # leaked ephemeral consumers slow the meta layer down
            for info in await self.bus.js.streams_info():
                consumers[str(info.config.name)] = info.state.consumer_count
        return {
            "consumers_by_stream": consumers,
            "pods_live": len(live),
            "vms_running": len(vms),
            "leaked_vms": len(leaked),
            "leaked": leaked,
            "pods_without_vm": without_vm,
            "lost_inputs": len(lost),
            "lost": lost,
            "violations": violations,
            "log_entries": report.entries,
            "decisions": report.decisions,
            "vms_created": report.vms_created,
            "vms_released": report.vms_released,
            "skipped": report.skipped,
            "keys": report.keys,
        }

    async def run(self) -> dict[str, Any]:
        self._t0 = time.monotonic()
        me = asyncio.current_task()
        if me is not None:  # SIGTERM/SIGINT still run the cleanup below (children live in own sessions)
            for sig in (signal.SIGTERM, signal.SIGINT):
                asyncio.get_running_loop().add_signal_handler(sig, me.cancel)
        result: dict[str, Any] = {"minutes": self.args.minutes, "runtime": self.runtime, "rng_seed": self.rng_seed}
        oracle = Oracle(self.run_dir, self.runtime, self.forced)
        tasks: list[asyncio.Task[None]] = []
        ok = False
        try:
            self.say(f"starting the stack in {self.run_dir} (runtime {self.runtime})")
            await self.start_stack()
            self.say("stack up; churn and faults begin")
            tasks.append(asyncio.create_task(oracle.run(), name="oracle"))
            reviver = asyncio.create_task(self.reviver(), name="reviver")
            tasks.append(reviver)
            churn = asyncio.create_task(self.churn(), name="churn")
            killer = asyncio.create_task(self.killer(), name="killer")
            chaos_t0 = time.monotonic()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop_faults.wait(), self.args.minutes * 60)
            if self.args.min_kills > 0:  # slow restarts must not leave a short window with too few faults
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._enough_kills.wait(), self.args.min_kills * MIN_KILL_WAIT_S)
            self._stop_faults.set()
            await asyncio.gather(churn, killer)  # the killer finishes its restart first
            result["chaos_seconds"] = round(time.monotonic() - chaos_t0, 1)
            await http_post_json(self.api_port, "/_dev/faults", {"reset": True})
            await self.settle(result, recheck_after_s=25.0)
            reviver.cancel()
            await asyncio.to_thread(oracle.sample)
            ok = True
        finally:
            await cancel_and_wait(tasks, what="chaos task")
            self._stop_faults.set()
            result.update(await self.stop_stack())
        result.update(
            {
                "seconds": round(time.monotonic() - self._t0, 1),
                "kills": dict(self.kills),
                "kills_total": sum(self.kills.values()),
                "pods_churned": sum(self.ops[k] for k in ("create", "recreate", "delete", "hibernate", "wake")),
                "ops": dict(self.ops),
                "max_vms_per_key": oracle.max_per_key,
                "max_vms_per_incarnation": oracle.max_per_incarnation,
                "oracle_samples": oracle.samples,
                "oracle_overlaps": oracle.worst[:20],
                "overlaps_after_force_delete": len(oracle.forced_overlaps),
                "overlaps_after_force_delete_first": oracle.forced_overlaps[:5],
                "unexpected_exits": dict(self.unexpected_exits),
                "restart_timeouts": self.restart_timeouts,
                "notes": self.notes[:20],
                "run_dir": str(self.run_dir),
            }
        )
        broken = bool(
            result["violations"] or result["leaked_vms"] or result["lost_inputs"] or result["pods_without_vm"]
            or result["max_vms_per_key"] > 1 or result["max_vms_per_incarnation"] > 1 or not result["quiesced"]
        )  # fmt: skip
        result["ok"] = ok and not broken
        if result["ok"] and not self.args.keep:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        return result
