"""``vmfence vnc <namespace/name>``: where a pod's VM's VNC display listens, and its password.

The pod's current fence comes from its annotations (``vmfence.io/vm-id``, ``/host``, ``/epoch``) and
``metadata.uid``, read through the kubeconfig: whoever may read the pod may ask. The host's agent
answers only to that fence (the ledger's owner of the VM, rule 9), on a reply subject under
``_VNC_INBOX.`` that only the NATS identity ``operator`` may read. The password goes to stdout and
nowhere else: no log line, no error message.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import secrets
from typing import Any

import msgspec
import nats.errors

from services.cli.common import CliError, kube_api, load_stack, open_bus, pod_key
from shared.bus.connect import Bus
from shared.bus.connect import log as bus_log
from shared.fence.keys import Key
from shared.fence.podspec import key_of_pod, uid_of
from shared.fence.schema import MAX_EPOCH, Fence
from shared.fence.vnc import VNC_REPLY_PREFIX, VncAnswer, VncQuery

# the placement annotations the reconciler writes on a pod (services/reconciler/kube.py)
ANN_VM_ID = "vmfence.io/vm-id"
ANN_HOST = "vmfence.io/host"
ANN_EPOCH = "vmfence.io/epoch"
QUERY_TIMEOUT_S = 5.0  # the agent's answer
READ_TIMEOUT_S = 30.0  # one pod read

_answer = msgspec.json.Decoder(VncAnswer)
_REFUSALS = {
    "not_owner": "the agent refused: the pod's fence does not own that VM (recreated or moved? try again)",
    "no_display": "the VM has no VNC display (the host's agent runs without --vnc-ports?)",
    "bad_request": "the agent refused the question as malformed",
    "reply_not_private": "the agent refused: the answer would not go to a private reply subject",
}


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("vnc", help="a pod's VM's VNC address and password (NATS user operator)")
    p.add_argument("pod", metavar="NAMESPACE/NAME", help="the pod")
    p.add_argument("--nats-url", "--nats", dest="nats", help="NATS URL (default: VMFENCE_NATS_URL or the local stack)")
    p.add_argument("--kubeconfig", help="the API the pod is in (default: the local stack's)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout: vm_id, host, url, password")
    p.set_defaults(run=vnc)


async def _read_pod(kubeconfig: str, namespace: str, name: str) -> dict[str, Any]:
    from kubernetes_asyncio import client
    from kubernetes_asyncio.client.exceptions import ApiException

    api_client = await kube_api(kubeconfig)
    async with api_client as api:
        try:
            resp: Any = await client.CoreV1Api(api).read_namespaced_pod(
                name, namespace, _preload_content=False, _request_timeout=READ_TIMEOUT_S)
            status = int(getattr(resp, "status", 200))  # unread responses do not raise on an error
            if status == 404:
                raise CliError(f"no pod {namespace}/{name}")
            if status >= 400:
                raise CliError(f"cannot read pod {namespace}/{name}: HTTP {status}")
            pod: dict[str, Any] = await resp.json()
        except ApiException as exc:
            if exc.status == 404:
                raise CliError(f"no pod {namespace}/{name}") from None
            raise CliError(f"cannot read pod {namespace}/{name}: {exc.status} {exc.reason}") from None
        except (OSError, TimeoutError) as exc:
            raise CliError(f"cannot read pod {namespace}/{name}: {exc}") from None
    return pod


def placement(pod: dict[str, Any]) -> tuple[str, str, Fence]:
    """The pod's host, VM id and current fence, from its annotations and uid."""
    meta = pod.get("metadata") or {}
    where = f"{meta.get('namespace')}/{meta.get('name')}"
    ann = meta.get("annotations") or {}
    vm_id, host, epoch = ann.get(ANN_VM_ID), ann.get(ANN_HOST), ann.get(ANN_EPOCH)
    if not isinstance(vm_id, str) or not isinstance(host, str) or not vm_id or not host:
        raise CliError(f"pod {where} has no VM yet (no {ANN_VM_ID}/{ANN_HOST} annotations)")
    try:
        n = int(str(epoch)) if isinstance(epoch, str) and len(epoch) <= 20 else -1
    except ValueError:
        n = -1
    if not 0 <= n <= MAX_EPOCH:
        raise CliError(f"pod {where} has no valid {ANN_EPOCH} annotation")
    key: Key = key_of_pod(pod)
    return host, vm_id, Fence(str(key), uid_of(pod), n)


class _Refusals(logging.Filter):
    """Takes the bus's asynchronous "permissions violation" warnings out of the output (the
    command says it once, in its own line) and remembers that one came."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = False

    def filter(self, record: logging.LogRecord) -> bool:
        if "permissions violation" in record.getMessage().lower():
            self.seen = True
            return False
        return True


async def ask(bus: Bus, host: str, query: VncQuery, timeout: float = QUERY_TIMEOUT_S) -> VncAnswer:  # noqa: ASYNC109
    """Ask ``host``'s agent, the answer on a private reply subject (not ``_INBOX.``, which every
    identity may read)."""
    refusals = _Refusals()
    bus_log.addFilter(refusals)
    try:
        return await _ask(bus, host, query, timeout, refusals)
    finally:
        bus_log.removeFilter(refusals)


async def _ask(bus: Bus, host: str, query: VncQuery, timeout: float, refusals: _Refusals) -> VncAnswer:  # noqa: ASYNC109
    reply = f"{VNC_REPLY_PREFIX}.{secrets.token_hex(16)}"
    got: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    async def on_reply(msg: Any) -> None:
        if got.done():
            return
        if msg.headers and msg.headers.get("Status") == "503":  # nobody listens on the subject
            got.set_exception(CliError(f"no agent answers for host {host} (is it running?)"))
        else:
            got.set_result(msg.data)

    try:
        sub = await bus.nc.subscribe(reply, cb=on_reply, max_msgs=1)
        await bus.nc.publish(bus.subjects.vnc_query(host), msgspec.json.encode(query), reply=reply)
        await bus.nc.flush()
    except nats.errors.Error as exc:
        raise CliError(f"cannot ask host {host}'s agent: {exc!r}") from None
    try:
        data = await asyncio.wait_for(got, timeout)
    except TimeoutError:
        if refusals.seen:
            raise CliError("NATS refused the question: this identity may not ask for VNC passwords "
                           "(VMFENCE_NATS_USER=operator)") from None
        raise CliError(f"host {host}'s agent did not answer within {timeout:g}s (not running, or this NATS "
                       "user may not ask: VMFENCE_NATS_USER=operator)") from None
    finally:
        await sub.unsubscribe()
    try:
        return _answer.decode(data)
    except msgspec.DecodeError:
        raise CliError(f"host {host}'s agent gave an answer that does not decode") from None


async def vnc(args: argparse.Namespace) -> int:
    namespace, name = pod_key(args.pod)
    kubeconfig = args.kubeconfig
    if kubeconfig is None and (stack := load_stack()) is not None:
        kubeconfig = stack.kubeconfig
    if not kubeconfig:
        raise CliError("no --kubeconfig given and no local stack (.vmfence/stack.json)")
    host, vm_id, fence = placement(await _read_pod(kubeconfig, namespace, name))
    bus = await open_bus(args.nats, "vmfence-vnc")
    try:
        answer = await ask(bus, host, VncQuery(vm_id=vm_id, fence=fence))
    finally:
        await bus.close()
    if answer.refused is not None:
        raise CliError(_REFUSALS.get(answer.refused, f"the agent refused: {answer.refused}"))
    if answer.vm_id != vm_id or not answer.port or not answer.password:
        raise CliError(f"host {host}'s agent answered for another VM or without a display")
    url = f"vnc://{answer.listen}:{answer.port}"
    if args.json:
        print(json.dumps({"pod": f"{namespace}/{name}", "vm_id": vm_id, "host": host, "listen": answer.listen,
                          "port": answer.port, "url": url, "password": answer.password}))
    else:
        print(url)
        print(answer.password)
    return 0
