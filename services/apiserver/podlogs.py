"""``pods/log`` as the real API server serves it: proxied to the kubelet endpoint of the pod's node
(issue 12 §3), and clear answers for ``exec``, ``attach`` and ``portforward``.

``GET /api/v1/namespaces/<ns>/pods/<name>/log`` finds the pod (404 if none), its container (the
only one, or ``container=``; several and none named is a 400 naming them), its node
(``spec.nodeName``; none is a 400), the node's ``InternalIP`` and
``status.daemonEndpoints.kubeletEndpoint.Port``, and streams
``https://<ip>:<port>/containerLogs/<ns>/<name>/<container>`` with the query (``follow``,
``tailLines``, ``sinceSeconds``, ``sinceTime``, ``timestamps``, ``previous``, ``limitBytes``) to the
client. The API server authenticates with its kubelet client certificate and checks the agent's
serving certificate against the kubelet CA (not its host name: agents' addresses are chosen when
they start). The kubelet's refusals come back as a Status with its code and words, as kubectl shows
them.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from .errors import ApiError
from .store import Store

LOG_PARAMS = ("follow", "tailLines", "sinceSeconds", "sinceTime", "timestamps", "previous", "limitBytes")
CONNECT_TIMEOUT_S = 10.0
NOT_A_CONTAINER = (
    "pod {ns}/{name} runs as a virtual machine (vmfence): {what} is not supported. Use `vmfence console "
    "{ns}/{name}` for its serial console; `kubectl logs` reads the same console."
)


@dataclass(frozen=True)
class KubeletClient:
    """The API server's side of the kubelet connection (None fields: not configured)."""

    cert: str | None = None
    key: str | None = None
    ca: str | None = None

    def context(self) -> ssl.SSLContext:
        if not (self.cert and self.key and self.ca):
            raise ApiError(503, "this development API server has no kubelet client certificate configured "
                                "(ApiServerConfig.kubelet_client_cert/key/ca): pod logs cannot be fetched",
                           "ServiceUnavailable")
        ctx = ssl.create_default_context(cafile=self.ca)
        ctx.check_hostname = False
        ctx.load_cert_chain(self.cert, self.key)
        return ctx


class PodLogs:
    def __init__(self, store: Store, client: KubeletClient) -> None:
        self.store = store
        self.client = client

    def _get(self, plural: str, ns: str | None, name: str) -> dict[str, Any]:
        rt = self.store.registry.lookup("", "v1", plural)
        assert rt is not None
        obj: dict[str, Any] = self.store.get(rt, ns, name)
        return obj

    def _where(self, ns: str, name: str, container: str | None) -> tuple[str, int, str]:
        pod = self._get("pods", ns, name)
        names = [c.get("name", "") for c in (pod.get("spec") or {}).get("containers") or []]
        if container is None:
            if len(names) != 1:
                raise ApiError(400, f"a container name must be specified for pod {name}, choose one of: "
                                    f"[{' '.join(names)}]", "BadRequest")
            container = names[0]
        elif container not in names:
            raise ApiError(400, f"container {container} is not valid for pod {name}", "BadRequest")
        node_name = (pod.get("spec") or {}).get("nodeName")
        if not node_name:
            raise ApiError(400, f'pod "{name}" does not have a host assigned', "BadRequest")
        node = self._get("nodes", None, node_name)
        status = node.get("status") or {}
        ips = [a.get("address") for a in status.get("addresses") or [] if a.get("type") == "InternalIP"]
        port = ((status.get("daemonEndpoints") or {}).get("kubeletEndpoint") or {}).get("Port")
        if not ips or not port:
            raise ApiError(400, f"node {node_name} advertises no kubelet endpoint (InternalIP and "
                                f"daemonEndpoints.kubeletEndpoint.Port)", "BadRequest")
        return str(ips[0]), int(port), container

    async def logs(self, request: web.Request) -> web.StreamResponse:
        ns, name = request.match_info["namespace"], request.match_info["name"]
        ip, port, container = self._where(ns, name, request.query.get("container"))
        params = {k: v for k, v in request.query.items() if k in LOG_PARAMS}
        host = f"[{ip}]" if ":" in ip else ip
        url = f"https://{host}:{port}/containerLogs/{ns}/{name}/{container}"
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S)
        try:
            async with aiohttp.ClientSession(timeout=timeout) as session, session.get(
                url, params=params, ssl=self.client.context()
            ) as upstream:
                if upstream.status != 200:
                    text = (await upstream.text()).strip()
                    raise ApiError(upstream.status, text or f"kubelet answered {upstream.status}",
                                   "BadRequest" if upstream.status == 400 else None)
                resp = web.StreamResponse(headers={"Content-Type": "text/plain"})
                await resp.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
                return resp
        except aiohttp.ClientError as exc:
            raise ApiError(500, f"Get \"{url}\": {exc}", "InternalError") from exc

    @staticmethod
    def not_a_container(what: str) -> Any:
        async def handler(request: web.Request) -> web.Response:
            ns, name = request.match_info["namespace"], request.match_info["name"]
            raise ApiError(400, NOT_A_CONTAINER.format(ns=ns, name=name, what=what), "BadRequest")

        return handler

    def register(self, router: web.UrlDispatcher) -> None:
        """Before the generic /api/v1 route: the subresources this module answers."""
        base = "/api/v1/namespaces/{namespace}/pods/{name}"
        router.add_get(f"{base}/log", self.logs)
        for what in ("exec", "attach", "portforward"):
            router.add_route("*", f"{base}/{what}", self.not_a_container(what))
