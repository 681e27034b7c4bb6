"""Subject, stream and bucket names: the one place that knows how a key maps onto the bus
(keys, their token encoding and partitions are in :mod:`shared.fence.keys`).
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.fence.keys import DEFAULT_PARTITIONS, Key, decode_token, encode_token, key_from_tokens, partition_of

DEFAULT_PREFIX = "vmfence"
PARTITION_TOKEN = "partition"  # the last token of a host's answer to a partition verify


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
    def stream_images(self) -> str:
        return f"{self.prefix.upper()}_IMAGES"

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

    def host_report(self, key: Key, host: str) -> str:
        """Agent reports bound to their sender: ``<prefix>.in.<p>.agent.<host>.<key tokens>``. NATS
        permissions let each agent publish only under its own host token, and the reconciler refuses
        a report whose ``host`` is not the subject's (``sender_of_in_subject``). ``report`` stays
        readable for the reconcilers' own outcomes and for agents not yet moved."""
        return f"{self.prefix}.in.{self.partition(key)}.agent.{encode_token(host)}.{key.tokens()}"

    def host_partition_report(self, p: int, host: str) -> str:
        """A host's answer to a partition's PartitionVerify: ``<prefix>.in.<p>.agent.<host>.partition``
        (one token after the host: no key's report subject has that shape)."""
        return f"{self.prefix}.in.{p}.agent.{encode_token(host)}.{PARTITION_TOKEN}"

    def partition_report_of(self, subject: str) -> tuple[int, str] | None:
        """(partition, host) of a ``host_partition_report`` subject; None for any other subject."""
        parts = subject.split(".")
        if (len(parts) == 6 and parts[0] == self.prefix and parts[1] == "in" and parts[3] == "agent"
                and parts[5] == PARTITION_TOKEN and parts[2].isdigit()):
            return int(parts[2]), decode_token(parts[4])
        return None

    def host_reports(self, host: str) -> str:
        """Every report subject of one host (what its agent's NATS user may publish to)."""
        return f"{self.prefix}.in.*.agent.{encode_token(host)}.>"

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
        if kind == "agent" and len(rest) >= 3:
            return key_from_tokens(rest[1:])
        raise ValueError(f"not an input subject: {subject!r}")

    def sender_of_in_subject(self, subject: str) -> str | None:
        """The host an agent report's subject binds it to (``host_report``); None for any other input
        subject (observations, the reconcilers' own outcomes, reports on the unbound ``report``)."""
        parts = subject.split(".")
        if len(parts) >= 7 and parts[0] == self.prefix and parts[1] == "in" and parts[3] == "agent":
            return decode_token(parts[4])
        return None

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

    def inventory_query(self, host: str) -> str:
        """Core NATS request/reply (not a stream): a host's agent answers with what it has now
        (``vmfence verify``); only read-only identities may ask, only that host's agent answers."""
        return f"{self.prefix}.agent.{encode_token(host)}.inventory"

    def vnc_query(self, host: str) -> str:
        """Core NATS request/reply: a host's agent answers with a VM's VNC address and password to
        its owner fence (``vmfence vnc``); only ``operator`` may ask, only that host's agent answers."""
        return f"{self.prefix}.agent.{encode_token(host)}.vnc"

    def dlq(self, source: str) -> str:
        return f"{self.prefix}.dlq.{encode_token(source)}"

    @property
    def dlq_all(self) -> str:
        return f"{self.prefix}.dlq.>"

    # partition images (services/reconciler/images.py): the latest of each partition
    def image(self, p: int) -> str:
        return f"{self.prefix}.image.{p}"

    @property
    def images_all(self) -> str:
        return f"{self.prefix}.image.>"
