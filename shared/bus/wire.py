"""What vmfence sends on the wire besides payloads: header names, JetStream error codes, and which
errors are transient."""

from __future__ import annotations

import nats
import nats.errors
import nats.js.errors

H_EXPECTED_LAST_SUBJECT_SEQ = "Nats-Expected-Last-Subject-Sequence"
H_MSG_ID = "Nats-Msg-Id"
H_REASON = "Vmfence-Reason"
H_ORIGINAL_SUBJECT = "Vmfence-Original-Subject"
META_PARTITIONS = "vmfence.partitions"

ERR_WRONG_LAST_SEQUENCE = 10071  # Nats-Expected-Last-Subject-Sequence did not match
ERR_IN_FLIGHT_PROPOSAL = (10163, 10164)  # R3: another proposal on the same subject is in flight
ERR_STREAM_NAME_IN_USE = 10058  # add_stream with a different config for an existing name
ERR_NO_SUITABLE_PEERS = 10005  # placement: a peer is offline or not yet caught up (a forming cluster)
RETRIABLE_HTTP_CODES = (503,)  # JetStream temporarily unavailable (no leader yet)

TRANSIENT = (TimeoutError, nats.js.errors.NoStreamResponseError, nats.errors.NoRespondersError)
"""Exceptions of one request that a retry may cure."""


def retriable_api_error(exc: nats.js.errors.APIError) -> bool:
    """Transient: another proposal in flight, no leader yet, or a placement a forming cluster (or
    one restarting a node) refuses until every peer has reported in, even after its meta leader
    saw them all."""
    return exc.err_code in (*ERR_IN_FLIGHT_PROPOSAL, ERR_NO_SUITABLE_PEERS) or exc.code in RETRIABLE_HTTP_CODES
