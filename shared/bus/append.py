"""Fenced appends (expected last subject sequence, disambiguated by Msg-Id) and plain retried publishes."""

from __future__ import annotations

import logging

import nats
import nats.errors
import nats.js.errors
from nats.js import JetStreamContext, api

from shared.bus.read import last_on_subject
from shared.bus.retry import Retry, retry_transient
from shared.bus.wire import (
    ERR_WRONG_LAST_SEQUENCE,
    H_EXPECTED_LAST_SUBJECT_SEQ,
    H_MSG_ID,
    TRANSIENT,
    retriable_api_error,
)

log = logging.getLogger(__name__)

APPEND_TIMEOUT_S = 5.0



class LostRace(Exception):
    """Someone else appended to the subject since the writer's expected sequence."""

    def __init__(self, subject: str, expected: int, actual_last_seq: int | None) -> None:
        super().__init__(f"lost race on {subject}: expected last seq {expected}, actual {actual_last_seq}")
        self.subject = subject
        self.expected = expected
        self.actual_last_seq = actual_last_seq


class AppendFailed(Exception):
    """An append could not be confirmed within its bounded retries (outcome unknown)."""




async def fenced_append(
    js: JetStreamContext,
    subject: str,
    payload: bytes,
    *,
    expected_last_subject_seq: int,
    msg_id: str,
    stream: str,
    timeout: float = APPEND_TIMEOUT_S,  # noqa: ASYNC109 - per request, not overall
    headers: dict[str, str] | None = None,
) -> int:
    """Append iff the subject's last sequence is expected_last_subject_seq (0 = empty subject).

    Returns the new stream sequence. Raises LostRace when another writer got there first and
    AppendFailed when retries run out. msg_id must identify *this writer's* entry (e.g. include the
    writer id or a content hash): a retry with the same msg_id that finds its own entry on top is
    reported as success, so two competing writers must never share a msg_id.
    """
    hdrs = dict(headers or {})
    hdrs[H_EXPECTED_LAST_SUBJECT_SEQ] = str(expected_last_subject_seq)
    hdrs[H_MSG_ID] = msg_id
    retry = Retry()
    while True:
        try:
            ack = await js.publish(subject, payload, timeout=timeout, stream=stream, headers=dict(hdrs))
            return int(ack.seq)  # duplicate=True (R3 retry) carries the original sequence
        except nats.js.errors.APIError as exc:
            if exc.err_code == ERR_WRONG_LAST_SEQUENCE:
                return await _resolve_wrong_last(js, stream, subject, msg_id, expected_last_subject_seq)
            if not retriable_api_error(exc):
                raise
            last_error: BaseException = exc
        except TRANSIENT as exc:
            last_error = exc  # maybe landed: the retry's Msg-Id/expected-seq resolves it
        log.debug("append to %s: retry %d after %r", subject, retry.attempt + 1, last_error)
        if not await retry.backoff():
            raise AppendFailed(
                f"append to {subject} unconfirmed after {retry.attempt} attempts: {last_error!r}"
            ) from last_error


async def _resolve_wrong_last(js: JetStreamContext, stream: str, subject: str, msg_id: str, expected: int) -> int:
    """10071: a benign retry if the subject's last message is ours, else a lost race."""
    last = await retry_transient(
        lambda: last_on_subject(js, stream, subject),
        lambda err, _: AppendFailed(
            f"append to {subject}: wrong last sequence and its last message is unreadable: {err!r}"),
    )
    if last is not None and last.headers.get(H_MSG_ID) == msg_id:
        return last.seq
    raise LostRace(subject, expected, None if last is None else last.seq)





async def publish_retrying(
    js: JetStreamContext, subject: str, payload: bytes, headers: dict[str, str], request_timeout_s: float
) -> api.PubAck:
    """Synchronous publish with bounded retries on transient errors (leader election, timeouts)."""
    return await retry_transient(
        lambda: js.publish(subject, payload, timeout=request_timeout_s, headers=dict(headers)),
        lambda err, retry: AppendFailed(f"publish to {subject} unconfirmed after {retry.attempt} attempts: {err!r}"),
    )


async def publish_input(
    js: JetStreamContext,
    subject: str,
    payload: bytes,
    *,
    msg_id: str,
    headers: dict[str, str] | None = None,
    timeout: float = APPEND_TIMEOUT_S,  # noqa: ASYNC109 - per request, not overall
) -> int:
    """Publish with Nats-Msg-Id (retries are deduplicated by the stream) and return its sequence."""
    hdrs = dict(headers or {})
    hdrs[H_MSG_ID] = msg_id
    ack = await publish_retrying(js, subject, payload, hdrs, timeout)
    return int(ack.seq)
