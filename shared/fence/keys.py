"""Keys and partitions: a fenced object's identity, its one-token encoding, and its stable partition.

A pod key is ``namespace/name``; a VirtualMachine key is ``vm:namespace/name``. Names are DNS
subdomains and may contain dots, which separate NATS subject tokens, so every name is encoded into a
single token reversibly (``%XX`` for anything outside ``[A-Za-z0-9_-]``).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Literal

DEFAULT_PARTITIONS = 16

KeyKind = Literal["pod", "vm"]

_SAFE = re.compile(r"[A-Za-z0-9_-]")
_ALL_SAFE = re.compile(r"[A-Za-z0-9_-]+")
_ESCAPE = re.compile(r"%([0-9A-F]{2})")
PARTITION_CACHE = 4096  # keys whose partition is remembered (a subject is built per message)


def encode_token(text: str) -> str:
    """Encode text into one subject token: safe characters stay, others become %XX (UTF-8 bytes)."""
    if not text:
        raise ValueError("empty subject token")
    if _ALL_SAFE.fullmatch(text):
        return text  # most names: nothing to escape
    out: list[str] = []
    for ch in text:
        if _SAFE.fullmatch(ch):
            out.append(ch)
        else:
            out.extend(f"%{b:02X}" for b in ch.encode())
    return "".join(out)


def decode_token(token: str) -> str:
    if "%" not in token:
        return token  # nothing escaped: each character stands for itself
    raw = bytearray()
    i = 0
    while i < len(token):
        if token[i] == "%":
            m = _ESCAPE.match(token, i)
            if m is None:
                raise ValueError(f"bad escape in subject token {token!r}")
            raw.append(int(m.group(1), 16))
            i += 3
        else:
            raw.extend(token[i].encode())
            i += 1
    return raw.decode()


def fnv1a32(data: bytes) -> int:
    h = 0x811C9DC5
    for b in data:
        h ^= b
        h = (h * 0x01000193) & 0xFFFFFFFF
    return h


@dataclass(frozen=True, slots=True)
class Key:
    """A fenced object's identity: kind plus namespace/name."""

    kind: KeyKind
    namespace: str
    name: str

    def __str__(self) -> str:
        base = f"{self.namespace}/{self.name}"
        return base if self.kind == "pod" else f"vm:{base}"

    @staticmethod
    def parse(text: str) -> Key:
        kind: KeyKind = "pod"
        if text.startswith("vm:"):
            kind, text = "vm", text[3:]
        ns, sep, name = text.partition("/")
        if not sep or not ns or not name or "/" in name:
            raise ValueError(f"not a key (want namespace/name or vm:namespace/name): {text!r}")
        return Key(kind, ns, name)

    def tokens(self) -> str:
        """The key's subject tokens after the partition: ``ns.name`` or ``vm.ns.name``."""
        base = f"{encode_token(self.namespace)}.{encode_token(self.name)}"
        return base if self.kind == "pod" else f"vm.{base}"


def partition_of(key: str | Key, partitions: int = DEFAULT_PARTITIONS) -> int:
    """Stable partition of a key: FNV-1a 32 of the key's text, mod P."""
    if partitions < 1:
        raise ValueError("partitions must be >= 1")
    return _partition(str(key), partitions)


@functools.lru_cache(maxsize=PARTITION_CACHE)
def _partition(text: str, partitions: int) -> int:
    return fnv1a32(text.encode()) % partitions


def key_from_tokens(tokens: list[str]) -> Key:
    """Inverse of Key.tokens(): two tokens for a pod key, ``vm`` plus two for a VM key."""
    if len(tokens) == 2:
        return Key("pod", decode_token(tokens[0]), decode_token(tokens[1]))
    if len(tokens) == 3 and tokens[0] == "vm":
        return Key("vm", decode_token(tokens[1]), decode_token(tokens[2]))
    raise ValueError(f"not key tokens: {'.'.join(tokens)!r}")
