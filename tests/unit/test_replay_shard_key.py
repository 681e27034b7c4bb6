"""The key a sharded replay reads from a record's first bytes is the key the record decodes to, for
every width of its sequence number and every length of its key; bytes of another shape fall back
to a decode, never to a wrong key (which would audit one key's entries in two processes)."""

from __future__ import annotations

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from services.cli.replayjobs import key_bytes
from shared.bus.logstream import Record, encode_record
from shared.fence.schema import LogEntry, Skipped

SEQS = st.one_of(st.sampled_from([0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1]),
                 st.integers(0, 2**63 - 1))
KEYS = st.one_of(st.sampled_from(["a/b", "shop/" + "x" * 26, "shop/" + "x" * 27, "n/" + "é" * 100]),
                 st.text(min_size=1, max_size=300))


@given(seq=SEQS, key=KEYS, error=st.sampled_from(["", "undecodable entry: x"]))
def test_the_key_read_from_the_first_bytes_is_the_decoded_key(seq: int, key: str, error: str) -> None:
    body = encode_record(Record(seq, LogEntry(key, 1, [Skipped("superseded", "u")]), 1.5, error))[4:]
    assert key_bytes(body, 0, len(body)) == key.encode()
    framed = b"junk" + body + b"tail"  # an offset into a larger buffer
    assert key_bytes(framed, 4, 4 + len(body)) == key.encode()


class _Reordered(msgspec.Struct):
    entry: LogEntry
    seq: int


def test_bytes_of_another_shape_fall_back_to_a_decode() -> None:
    body = msgspec.msgpack.encode(_Reordered(LogEntry("shop/cart", 1, []), 7))
    assert key_bytes(body, 0, len(body)) == b"shop/cart"


def test_the_parent_takes_a_smaller_share_of_the_keys_for_its_scan() -> None:
    """The parent reads every key and audits shard 0: it gets less than an equal share, so every
    process has about the same work; every shard gets keys."""
    from collections import Counter

    from services.cli.replayjobs import parent_share, shard_of

    keys = [f"ns/pod-{i}" for i in range(20_000)]
    assert parent_share(1) == 1.0 and all(shard_of(k, 1) == 0 for k in keys[:100])
    for n in range(2, 9):
        got = Counter(shard_of(k, n) for k in keys)
        assert set(got) <= set(range(n))
        assert abs(got[0] / len(keys) - parent_share(n)) < 0.02, (n, got)
        assert parent_share(n) < 1 / n
        workers = [got[i] for i in range(1, n)]
        assert min(workers) > 0.8 * max(workers), (n, got)
