"""The VNC question an operator asks a host's agent, and its answer (pure structs).

A VM's VNC display has a password of its own, kept with the display's reservation in the agent's
ledger and owned by the VM's fence (rule 9). ``vmfence vnc`` reads the pod's fence from its
annotations (whoever may read the pod may know it) and asks the host's agent on core request/reply
(``Subjects.vnc_query``); the agent answers only when the fence asked is its ledger's owner of that
VM. The answer travels on a reply subject under ``VNC_REPLY_PREFIX``, which only the ``operator``
identity may subscribe to (``_INBOX.>`` is every identity's), and the agent answers on no other.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from shared.fence.schema import Fence

VNC_REPLY_PREFIX = "_VNC_INBOX"  # reply subjects of VNC questions: only `operator` subscribes here
MAX_VNC_QUERY_BYTES = 4096  # a question is a VM id and a fence; anything larger is refused unread

VncRefusal = Literal[
    "bad_request",  # not a VncQuery, or too large
    "reply_not_private",  # the reply subject is not under VNC_REPLY_PREFIX: others could read it
    "not_owner",  # the fence asked is not the ledger's owner of that VM (or no such VM)
    "no_display",  # the owner's VM has no VNC display
]


class VncQuery(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Which VM's display, asked under which fence (the pod's current one, from its annotations)."""

    vm_id: str
    fence: Fence


class VncAnswer(msgspec.Struct, frozen=True, omit_defaults=True):
    """Where the display listens and its password, or why not (``refused``; then nothing else)."""

    vm_id: str
    listen: str = ""
    port: int = 0
    password: str = ""
    refused: VncRefusal | None = None

    def __repr__(self) -> str:  # never the password in a log line or a traceback
        return f"VncAnswer(vm_id={self.vm_id!r}, listen={self.listen!r}, port={self.port}, refused={self.refused!r})"
