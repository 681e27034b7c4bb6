"""Subject tokens and partitions: the fast paths give exactly what the character-by-character
encoding and the plain FNV-1a give (a changed partition would move keys between writers)."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.fence.keys import Key, decode_token, encode_token, fnv1a32, partition_of


def reference_encode(text: str) -> str:
    return "".join(ch if re.fullmatch(r"[A-Za-z0-9_-]", ch) else "".join(f"%{b:02X}" for b in ch.encode())
                   for ch in text)


@given(st.text(min_size=1, max_size=40))
def test_encode_matches_reference_and_round_trips(text: str) -> None:
    token = encode_token(text)
    assert token == reference_encode(text)
    assert "." not in token and "*" not in token and ">" not in token and " " not in token
    assert decode_token(token) == text


@given(st.from_regex(r"[A-Za-z0-9_-]{1,30}", fullmatch=True))
def test_safe_names_are_their_own_token(text: str) -> None:
    assert encode_token(text) == text == decode_token(text)


def test_bad_escape_is_refused() -> None:
    with pytest.raises(ValueError):
        decode_token("a%zz")
    with pytest.raises(ValueError):
        encode_token("")


@given(st.text(min_size=1, max_size=20), st.text(min_size=1, max_size=20), st.integers(1, 64))
def test_partition_is_fnv1a_of_the_key_text(ns: str, name: str, partitions: int) -> None:
    key = Key("pod", ns.replace("/", "_"), name.replace("/", "_"))
    expected = fnv1a32(str(key).encode()) % partitions
    assert partition_of(key, partitions) == expected == partition_of(str(key), partitions)


def test_partition_values_are_stable() -> None:
    # FNV-1a 32 of the key text, computed by hand: a deployment's keys never change partition
    h = 0x811C9DC5
    for b in b"default/web-0":
        h = ((h ^ b) * 0x01000193) & 0xFFFFFFFF
    assert partition_of("default/web-0", 16) == h % 16
    assert partition_of(Key("vm", "ns", "a.b"), 7) == fnv1a32(b"vm:ns/a.b") % 7
