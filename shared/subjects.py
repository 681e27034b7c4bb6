"""Keys, partitions and subject names: the one place that knows how a key maps onto the bus.

A pod key is ``namespace/name``; a VirtualMachine key is ``vm:namespace/name``. Names are DNS
subdomains and may contain dots, which separate NATS subject tokens, so every name is encoded into a
single token reversibly (``%XX`` for anything outside ``[A-Za-z0-9_-]``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

DEFAULT_PREFIX = "vmfence"
DEFAULT_PARTITIONS = 16

KeyKind = Literal["pod", "vm"]

_SAFE = re.compile(r"[A-Za-z0-9_-]")
_ESCAPE = re.compile(r"%([0-9A-F]{2})")


def encode_token(text: str) -> str:
    """Encode text into one subject token: safe characters stay, others become %XX (UTF-8 bytes)."""
    if not text:
        raise ValueError("empty subject token")
    out: list[str] = []
    for ch in text:
        if _SAFE.fullmatch(ch):
            out.append(ch)
        else:
            out.extend(f"%{b:02X}" for b in ch.encode())
    return "".join(out)


def decode_token(token: str) -> str:
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
    return fnv1a32(str(key).encode()) % partitions


def key_from_tokens(tokens: list[str]) -> Key:
    """Inverse of Key.tokens(): two tokens for a pod key, ``vm`` plus two for a VM key."""
    if len(tokens) == 2:
        return Key("pod", decode_token(tokens[0]), decode_token(tokens[1]))
    if len(tokens) == 3 and tokens[0] == "vm":
        return Key("vm", decode_token(tokens[1]), decode_token(tokens[2]))
    raise ValueError(f"not key tokens: {'.'.join(tokens)!r}")


@dataclass(frozen=True, slots=True)
class Subjects:
    """Stream and subject names for one deployment prefix and partition count."""

    prefix: str = DEFAULT_PREFIX
    partitions: int = DEFAULT_PARTITIONS

    # streams and buckets
    @property
    def stream_in(self) -> str:
        return f"{self.prefix.upper()}_IN"

    @property
    def stream_log(self) -> str:
        return f"{self.prefix.upper()}_LOG"

    @property
    def stream_cmd(self) -> str:
        return f"{self.prefix.upper()}_CMD"

    @property
    def stream_dlq(self) -> str:
        return f"{self.prefix.upper()}_DLQ"

    @property
    def kv_leases(self) -> str:
        return f"{self.prefix}_leases"

    @property
    def kv_hosts(self) -> str:
        return f"{self.prefix}_hosts"

    def partition(self, key: str | Key) -> int:
        return partition_of(key, self.partitions)

    # inputs
    def observation(self, key: Key) -> str:
        """Watcher observations: ``<prefix>.in.<p>.pod.<ns>.<name>`` or ``.vm.<ns>.<name>``."""
        kind_token = "pod" if key.kind == "pod" else "vm"
        base = f"{encode_token(key.namespace)}.{encode_token(key.name)}"
        return f"{self.prefix}.in.{self.partition(key)}.{kind_token}.{base}"

    def report(self, key: Key) -> str:
        """Agent reports and effect outcomes: ``<prefix>.in.<p>.report.<key tokens>``."""
        return f"{self.prefix}.in.{self.partition(key)}.report.{key.tokens()}"

    def in_partition(self, p: int) -> str:
        return f"{self.prefix}.in.{p}.>"

    @property
    def in_all(self) -> str:
        return f"{self.prefix}.in.>"

    def key_of_in_subject(self, subject: str) -> Key:
        parts = subject.split(".")
        # prefix may itself not contain dots; validated in config
        if len(parts) < 5 or parts[0] != self.prefix or parts[1] != "in":
            raise ValueError(f"not an input subject: {subject!r}")
        kind, rest = parts[3], parts[4:]
        if kind == "pod" and len(rest) == 2:
            return key_from_tokens(rest)
        if kind == "vm" and len(rest) == 2:
            return key_from_tokens(["vm", *rest])
        if kind == "report":
            return key_from_tokens(rest)
        raise ValueError(f"not an input subject: {subject!r}")

    # decision log
    def log(self, key: Key) -> str:
        return f"{self.prefix}.log.{self.partition(key)}.{key.tokens()}"

    def log_partition(self, p: int) -> str:
        return f"{self.prefix}.log.{p}.>"

    @property
    def log_all(self) -> str:
        return f"{self.prefix}.log.>"

    def key_of_log_subject(self, subject: str) -> Key:
        parts = subject.split(".")
        if len(parts) < 5 or parts[0] != self.prefix or parts[1] != "log":
            raise ValueError(f"not a log subject: {subject!r}")
        return key_from_tokens(parts[3:])

    # commands and dead letters
    def command(self, host: str) -> str:
        return f"{self.prefix}.cmd.{encode_token(host)}"

    @property
    def cmd_all(self) -> str:
        return f"{self.prefix}.cmd.>"

    def dlq(self, source: str) -> str:
        return f"{self.prefix}.dlq.{encode_token(source)}"

    @property
    def dlq_all(self) -> str:
        return f"{self.prefix}.dlq.>"
