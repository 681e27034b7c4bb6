"""Dead letters: an unprocessable message parked on <prefix>.dlq.<source> with why and where from."""

from __future__ import annotations

from collections.abc import Mapping

from nats.js import JetStreamContext

from shared.bus.append import APPEND_TIMEOUT_S, publish_retrying
from shared.bus.wire import H_ORIGINAL_SUBJECT, H_REASON
from shared.subjects import Subjects


async def dead_letter(
    js: JetStreamContext,
    subjects: Subjects,
    *,
    source: str,
    reason: str,
    subject: str,
    data: bytes,
    headers: Mapping[str, str] | None = None,
) -> None:
    """Park an unprocessable message on ``<prefix>.dlq.<source>`` with why and where it came from.

    The original's Nats-* headers are dropped (a Msg-Id would dedupe unrelated dead letters).
    """
    hdrs = {k: v for k, v in (headers or {}).items() if not k.startswith("Nats-")}
    hdrs[H_REASON] = reason.replace("\r", " ").replace("\n", " ")
    hdrs[H_ORIGINAL_SUBJECT] = subject
    await publish_retrying(js, subjects.dlq(source), data, hdrs, APPEND_TIMEOUT_S)
