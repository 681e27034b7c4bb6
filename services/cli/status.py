"""`vmfence status`: who owns which partition, which hosts are alive with how many VMs, how far
behind each partition's consumer is, and pods per phase when a kubeconfig is at hand."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections import Counter
from typing import Any

import msgspec
import nats.js.errors
from rich.console import Console
from rich.table import Table

from services.cli.common import load_stack, open_bus
from shared.bus.leases import LeaseValue
from shared.fence.heartbeat import HostHeartbeat

MEMBER_PREFIX = "member."


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("status", help="partitions and owners, hosts, VMs, consumer lag, pods per phase")
    p.add_argument("--nats-url", "--nats", dest="nats", help="NATS URL (default: VMFENCE_NATS_URL or the local stack)")
    p.add_argument("--kubeconfig", help="also count pods per phase (default: the local stack's)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.set_defaults(run=status)


async def collect(args: argparse.Namespace) -> dict[str, Any]:
    bus = await open_bus(args.nats, "vmfence-status")
    out: dict[str, Any] = {"partitions": [], "hosts": [], "reconcilers": [], "pods_by_phase": None}
    try:
        subjects = bus.subjects
        leases = await bus.js.key_value(subjects.kv_leases)
        owners: dict[str, str] = {}
        with contextlib.suppress(nats.js.errors.NoKeysError):
            for k in await leases.keys():
                entry = await leases.get(k)
                if entry.value:
                    value = msgspec.json.decode(entry.value, type=LeaseValue)
                    if k.startswith(MEMBER_PREFIX):
                        out["reconcilers"].append(value.owner)
                    else:
                        owners[k] = value.owner
        for p in range(subjects.partitions):
            pending = None
            with contextlib.suppress(Exception):
                info = await bus.js.consumer_info(subjects.stream_in, f"reconciler-p{p}")
                pending = (info.num_pending or 0) + (info.num_ack_pending or 0)
            out["partitions"].append({"partition": p, "owner": owners.get(str(p)), "lag": pending})
        hosts = await bus.js.key_value(subjects.kv_hosts)
        with contextlib.suppress(nats.js.errors.NoKeysError):
            for k in await hosts.keys():
                entry = await hosts.get(k)
                if not entry.value:
                    continue
                beat = msgspec.json.decode(entry.value, type=HostHeartbeat)
                out["hosts"].append(
                    {
                        "host": beat.host, "runtime": beat.runtime, "vms": beat.vms,
                        "heartbeat_age_s": round(max(0.0, time.time() - beat.at), 1),
                        "cpus_free": beat.cpus_free, "memory_free_mib": beat.memory_free_mib,
                        "accel": beat.accel,
                    }
                )
        kubeconfig = args.kubeconfig
        if kubeconfig is None and (stack := load_stack()) is not None:
            kubeconfig = stack.kubeconfig
        if kubeconfig:
            out["pods_by_phase"] = await _pods_by_phase(kubeconfig)
    finally:
        await bus.close()
    return out


async def _pods_by_phase(kubeconfig: str) -> dict[str, int] | None:
    from kubernetes_asyncio import client, config

    from shared.kubeclient import api_client

    cfg = client.Configuration()
    try:
        await config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
        async with api_client(cfg) as api:
            pods = await client.CoreV1Api(api).list_pod_for_all_namespaces(_request_timeout=5)
    except Exception:
        return None
    return dict(Counter((p.status.phase if p.status else None) or "Unknown" for p in pods.items))


async def status(args: argparse.Namespace) -> int:
    data = await collect(args)
    if args.json:
        sys.stdout.write(json.dumps(data) + "\n")
        return 0
    console = Console()
    t = Table(title="partitions")
    t.add_column("p", justify="right")
    t.add_column("owner")
    t.add_column("lag", justify="right")
    for row in data["partitions"]:
        t.add_row(str(row["partition"]), row["owner"] or "[red]none[/red]", str(row["lag"] or 0))
    console.print(t)
    h = Table(title="hosts")
    for col in ("host", "runtime", "vms", "heartbeat age (s)", "cpus free", "memory free (MiB)"):
        h.add_column(col)
    for row in sorted(data["hosts"], key=lambda r: r["host"]):
        h.add_row(row["host"], row["runtime"], str(row["vms"]), str(row["heartbeat_age_s"]),
                  str(row["cpus_free"]), str(row["memory_free_mib"]))
    console.print(h)
    console.print(f"reconcilers: {', '.join(data['reconcilers']) or 'none'}")
    if data["pods_by_phase"] is not None:
        console.print("pods: " + ", ".join(f"{k} {v}" for k, v in sorted(data["pods_by_phase"].items())))
    return 0
