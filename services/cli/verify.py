"""`vmfence verify`: the log's end state against the world — every live host's inventory (asked on
the bus) and the API server's pods and VirtualMachines. Exit 1 on drift.

``replay`` proves the log agrees with itself; this proves the world agrees with the log. It looks
twice, ``--interval`` apart, and reports only drift seen both times: one look of a live system
catches VMs mid-transition.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import sys
import time
from typing import Any

import msgspec
import nats.errors
import nats.js.errors

from services.cli.common import CliError, kube_api, load_stack, open_bus
from shared.bus.connect import Bus
from shared.bus.logstream import read_log
from shared.fence.drift import ApiObject, Drift, DriftReport, HostVM, InventoryAnswer, drift
from shared.fence.podspec import deleting, is_ours, key_of_pod, key_of_vm, resource_version, uid_of
from shared.fence.state import KeyState, fold_all

QUERY_TIMEOUT_S = 5.0  # one host's inventory answer
LIST_TIMEOUT_S = 30.0  # one API list
_answer = msgspec.json.Decoder(InventoryAnswer)


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("verify", help="the log's end state against agents' inventories and the API (exit 1 on drift)")
    p.add_argument("--nats-url", "--nats", dest="nats", help="NATS URL (default: VMFENCE_NATS_URL or the local stack)")
    p.add_argument("--kubeconfig", help="the API to compare with (default: the local stack's; none: skip the API)")
    p.add_argument("--stuck-after", type=float, default=60.0, metavar="SECONDS",
                   help="a key whose object changed is stuck after this long without an entry")
    p.add_argument("--interval", type=float, default=2.0, metavar="SECONDS",
                   help="between the two looks (drift must be seen in both)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.set_defaults(run=verify)


async def _log_states(bus: Bus) -> tuple[dict[str, KeyState], dict[str, float]]:
    states: dict[str, KeyState] = {}
    last: dict[str, float] = {}
    async for rec in read_log(bus.js, bus.subjects):
        e = rec.entry
        s = states.get(e.key)
        if s is None:
            s = states[e.key] = KeyState(key=e.key)
        fold_all(s, e.decisions)
        s.n = e.n
        last[e.key] = rec.ts or rec.written_at()
    return states, last


async def _hosts(bus: Bus) -> list[str]:
    """Hosts with a live heartbeat: the bucket's subjects (stream info lists them exactly; a KV
    keys() watch can end before its first value), less deleted and purged keys."""
    bucket = bus.subjects.kv_hosts
    prefix = f"$KV.{bucket}."
    info = await bus.js.stream_info(f"KV_{bucket}", subjects_filter=f"{prefix}>")
    kv = await bus.js.key_value(bucket)
    hosts = []
    for subject in sorted((info.state.subjects or {}).keys()):
        host = subject.removeprefix(prefix)
        with contextlib.suppress(nats.js.errors.KeyNotFoundError):  # KeyDeletedError is one
            entry = await kv.get(host)
            if entry.value:
                hosts.append(host)
    return hosts


async def _inventory(bus: Bus, host: str) -> list[HostVM] | None:
    try:
        msg = await bus.nc.request(bus.subjects.inventory_query(host), b"", timeout=QUERY_TIMEOUT_S)
        answer = _answer.decode(msg.data)
    except (nats.errors.Error, TimeoutError, msgspec.DecodeError):
        return None
    return list(answer.vms) if answer.host == host else None


def _created_s(obj: dict[str, Any]) -> float:
    stamp = (obj.get("metadata") or {}).get("creationTimestamp")
    if not isinstance(stamp, str):
        return 0.0
    try:
        return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


async def _api_objects(kubeconfig: str) -> list[ApiObject]:
    from kubernetes_asyncio import client
    from kubernetes_asyncio.client.exceptions import ApiException

    api_client = await kube_api(kubeconfig)
    out: list[ApiObject] = []
    async with api_client as api:
        try:
            resp = await client.CoreV1Api(api).list_pod_for_all_namespaces(
                _preload_content=False, _request_timeout=LIST_TIMEOUT_S)
            pods = (await resp.json()).get("items") or []
        except (ApiException, OSError) as exc:
            raise CliError(f"cannot list pods: {exc}") from None
        for pod in pods:
            if is_ours(pod):
                out.append(ApiObject(str(key_of_pod(pod)), uid_of(pod), resource_version(pod), deleting(pod),
                                     _created_s(pod)))
        try:
            resp = await client.CustomObjectsApi(api).list_cluster_custom_object(
                "vmfence.io", "v1alpha1", "virtualmachines", _preload_content=False, _request_timeout=LIST_TIMEOUT_S)
            vms = (await resp.json()).get("items") or []
        except ApiException as exc:
            if exc.status != 404:  # no CRD: no VirtualMachines to compare
                raise CliError(f"cannot list VirtualMachines: {exc.reason}") from None
            vms = []
        for obj in vms:
            out.append(ApiObject(str(key_of_vm(obj)), uid_of(obj), resource_version(obj), deleting(obj),
                                 _created_s(obj)))
    return out


async def look(bus: Bus, kubeconfig: str | None, stuck_after_s: float) -> DriftReport:
    """One look: the log folded, every live host asked, the API listed, compared."""
    states, last = await _log_states(bus)
    hosts = await _hosts(bus)
    answers = await asyncio.gather(*(_inventory(bus, h) for h in hosts))
    objects = await _api_objects(kubeconfig) if kubeconfig else []
    return drift(states, dict(zip(hosts, answers, strict=True)), objects, last_entry_s=last, now_s=time.time(),
                 stuck_after_s=stuck_after_s)


def persistent(first: DriftReport, second: DriftReport) -> DriftReport:
    """The second look's drift that the first look saw too."""
    seen = {(d.kind, d.key, d.host, d.vm_id) for d in first.drift}
    kept = [d for d in second.drift if (d.kind, d.key, d.host, d.vm_id) in seen]
    return DriftReport(keys=second.keys, vms_checked=second.vms_checked, objects_checked=second.objects_checked,
                       drift=kept)


async def verify(args: argparse.Namespace) -> int:
    kubeconfig = args.kubeconfig
    if kubeconfig is None and (stack := load_stack()) is not None:
        kubeconfig = stack.kubeconfig
    if kubeconfig == "none":
        kubeconfig = None
    bus = await open_bus(args.nats, "vmfence-verify")
    try:
        first = await look(bus, kubeconfig, args.stuck_after)
        second = first
        if first.drift and args.interval > 0:
            await asyncio.sleep(args.interval)  # a second look, not a synchronisation: drift must last
            second = persistent(first, await look(bus, kubeconfig, args.stuck_after))
    finally:
        await bus.close()
    if args.json:
        out = msgspec.to_builtins(second)
        out["clean"] = second.clean
        out["api_checked"] = kubeconfig is not None
        sys.stdout.write(msgspec.json.encode(out).decode() + "\n")
    else:
        _print(second, kubeconfig is not None)
    return 0 if second.clean else 1


def _print(report: DriftReport, api: bool) -> None:
    print(f"keys {report.keys}, VMs checked {report.vms_checked}, "
          f"objects checked {report.objects_checked if api else '(no API: --kubeconfig)'}")
    for d in report.drift:
        print(_line(d))
    print("verdict: " + ("no drift" if report.clean else f"{len(report.drift)} drift(s)"))


def _line(d: Drift) -> str:
    parts = (d.key and f"key {d.key}", d.host and f"host {d.host}", d.vm_id and f"vm {d.vm_id}")
    where = " ".join(x for x in parts if x)
    return f"DRIFT {d.kind}: {where}: {d.detail}"
