"""``vmfence console NAMESPACE/NAME``: an interactive serial console of a pod's VM, through its
host's agent (issue 12 §3).

The pod's node (``spec.nodeName``) is read through the kubeconfig, the node's ``InternalIP`` and
kubelet port (``status.daemonEndpoints``) name the agent's endpoint, and a websocket to
``/console/<ns>/<name>`` carries the console both ways, authenticated by a client certificate the
agent accepts (``--console-client-names``, default ``vmfence-console``; a local stack makes one in
``<stack dir>/kubelet-pki``). The terminal is raw while attached; ``Ctrl-]`` detaches.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import ssl
import sys
import termios
import tty
from typing import Any

from services.cli.common import CliError, eprint, kube_api, load_stack, pod_key

DETACH = b"\x1d"  # Ctrl-]
READ_TIMEOUT_S = 10.0


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("console", help="a pod's VM's serial console, through its agent (Ctrl-] detaches)")
    p.add_argument("pod", metavar="NAMESPACE/NAME", help="the pod")
    p.add_argument("--kubeconfig", help="the API the pod is in (default: the local stack's)")
    p.add_argument("--cert", help="client certificate the agent accepts (default: the local stack's console.crt)")
    p.add_argument("--key", help="its key (default: the local stack's console.key)")
    p.add_argument("--ca", help="CA of the agents' serving certificates (default: the local stack's kubelet CA)")
    p.set_defaults(run=console)


async def endpoint(kubeconfig: str, ns: str, name: str) -> tuple[str, int]:
    """The agent's kubelet address and port for the pod's node."""
    from kubernetes_asyncio import client
    from kubernetes_asyncio.client.exceptions import ApiException

    api_client = await kube_api(kubeconfig)
    async with api_client as api:
        core = client.CoreV1Api(api)
        try:
            pod: Any = await core.read_namespaced_pod(name, ns, _request_timeout=READ_TIMEOUT_S)
            if not pod.spec.node_name:
                raise CliError(f"pod {ns}/{name} is not on a node yet")
            node: Any = await core.read_node(pod.spec.node_name, _request_timeout=READ_TIMEOUT_S)
        except ApiException as exc:
            raise CliError(f"{ns}/{name}: {exc.status} {exc.reason}") from None
    ips = [a.address for a in node.status.addresses or [] if a.type == "InternalIP"]
    ep = node.status.daemon_endpoints.kubelet_endpoint if node.status.daemon_endpoints else None
    if not ips or ep is None or not ep.port:
        raise CliError(f"node {pod.spec.node_name} advertises no kubelet endpoint (its agent serves none)")
    return str(ips[0]), int(ep.port)


def _tls(args: argparse.Namespace, kubeconfig: str) -> ssl.SSLContext:
    pki = os.path.join(os.path.dirname(os.path.abspath(kubeconfig)), "kubelet-pki")
    cert = args.cert or os.path.join(pki, "console.crt")
    key = args.key or os.path.join(pki, "console.key")
    ca = args.ca or os.path.join(pki, "kubelet-ca.crt")
    for what, path in (("certificate", cert), ("key", key), ("CA", ca)):
        if not os.path.isfile(path):
            raise CliError(f"no console {what} at {path} (--cert/--key/--ca)")
    ctx = ssl.create_default_context(cafile=ca)
    ctx.check_hostname = False  # the agents' address is chosen when they start; the CA is what is checked
    ctx.load_cert_chain(cert, key)
    return ctx


async def attach(url: str, ctx: ssl.SSLContext, stdin: int, stdout: int) -> str:
    """Relay ``stdin`` to the console and the console to ``stdout`` until Ctrl-] or the VM ends;
    why it ended."""
    import aiohttp

    loop = asyncio.get_running_loop()
    keys: asyncio.Queue[bytes] = asyncio.Queue()

    def typed() -> None:
        try:
            keys.put_nowait(os.read(stdin, 1024))
        except OSError:
            keys.put_nowait(b"")

    async with aiohttp.ClientSession() as session:
        try:
            ws = await session.ws_connect(url, ssl=ctx, heartbeat=30.0)
        except aiohttp.WSServerHandshakeError as exc:
            why = exc.message
            with contextlib.suppress(aiohttp.ClientError):  # the refusal's words are in its body
                async with session.get("https" + url[3:], ssl=ctx) as r:
                    why = (await r.text()).strip() or why
            raise CliError(f"the agent refused the console ({exc.status}): {why}") from None
        except aiohttp.ClientError as exc:
            raise CliError(f"cannot reach the agent at {url}: {exc}") from None
        loop.add_reader(stdin, typed)
        try:
            async def to_vm() -> str:
                while True:
                    data = await keys.get()
                    if not data:
                        return "end of input"
                    if DETACH in data:
                        before = data.split(DETACH, 1)[0]
                        if before:
                            await ws.send_bytes(before)
                        return "detached"
                    await ws.send_bytes(data)

            async def from_vm() -> str:
                async for msg in ws:
                    if msg.type == aiohttp.WSMsgType.BINARY:
                        os.write(stdout, msg.data)
                return "the console closed (the VM stopped or left the host)"

            tasks = [asyncio.ensure_future(to_vm()), asyncio.ensure_future(from_vm())]
            done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            return str(next(iter(done)).result())
        finally:
            loop.remove_reader(stdin)
            await ws.close()


async def console(args: argparse.Namespace) -> int:
    ns, name = pod_key(args.pod)
    kubeconfig = args.kubeconfig
    if kubeconfig is None and (stack := load_stack()) is not None:
        kubeconfig = stack.kubeconfig
    if not kubeconfig:
        raise CliError("no --kubeconfig given and no local stack (.vmfence/stack.json)")
    ctx = _tls(args, kubeconfig)
    host, port = await endpoint(kubeconfig, ns, name)
    url = f"wss://{host}:{port}/console/{ns}/{name}"
    stdin, stdout = sys.stdin.fileno(), sys.stdout.fileno()
    saved = termios.tcgetattr(stdin) if os.isatty(stdin) else None
    eprint(f"console of {ns}/{name} ({host}:{port}); Ctrl-] detaches")
    try:
        if saved is not None:
            tty.setraw(stdin)
        why = await attach(url, ctx, stdin, stdout)
    finally:
        if saved is not None:
            with contextlib.suppress(termios.error):
                termios.tcsetattr(stdin, termios.TCSADRAIN, saved)
    eprint(f"\r\n{why}")
    return 0
