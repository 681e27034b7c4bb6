"""Certificates for the agents' kubelet endpoints on a local stack (issue 12 §3): one CA, the API
server's kubelet client certificate (``kube-apiserver-kubelet-client``, the name the agents accept),
the operator's console certificate (``vmfence-console``) and one serving certificate the agents share
(the API server checks it against the CA, not a host name: the agents' addresses are chosen when
they start)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from services.testbed.kubecp.pki import Pair, _ca, _leaf, _save

CLIENT_NAME = "kube-apiserver-kubelet-client"
CONSOLE_NAME = "vmfence-console"


@dataclass(frozen=True)
class KubeletPki:
    ca: Path
    client: Pair  # the API server's
    server: Pair  # every agent's
    console: Pair  # the operator's (vmfence console)


def make_kubelet_pki(directory: Path, *, client_name: str = CLIENT_NAME) -> KubeletPki:
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    ca = _ca("vmfence-kubelet-ca")
    ca_pair = _save(directory, "kubelet-ca", ca)
    return KubeletPki(
        ca=ca_pair.cert,
        client=_save(directory, "apiserver-kubelet-client", _leaf(ca, client_name)),
        server=_save(directory, "kubelet-serving", _leaf(ca, "vmfence-agent", server=True, dns=("localhost",),
                                                         ips=("127.0.0.1",))),
        console=_save(directory, "console", _leaf(ca, CONSOLE_NAME)),
    )
