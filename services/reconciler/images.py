"""Partition images on the bus: what one writer of a partition leaves the next.

A reconciler's snapshot (``snapshot.py``) is its own file. A reconciler that takes a partition
another one held reads every entry since *its own* last snapshot of it, which grows with the time
since it last held that partition: 12 000 entries a partition right after a 10 000-pod burst, and a
week's worth after a week. An image is the same rows and watermark, put on the bus (stream
``<PREFIX>_IMAGES``, subject ``<prefix>.image.<p>``, the latest one kept) when a partition is handed
over and every ``--image-interval`` while it is held. Whoever takes the partition loads whichever of
its own snapshot and the image is further along, then the log after it: what a take reads is bounded
by the image interval, not by history.

The log stays the truth. Image rows are checked against the log exactly as a snapshot's are
(``Partition.load``). An image that is not one (undecodable, larger than ``MAX_IMAGE_BYTES``
decompressed, a newer schema), of another stream (a recreated bus), of another partition, or with a
row of a key outside its partition, is ignored as a whole, logged and counted: it costs only
catch-up time. Only reconcilers may write or read the stream (``deploy/nats/accounts.conf``).
"""

from __future__ import annotations

import logging
import zlib

import msgspec
import nats.errors
import nats.js.errors
from nats.js import JetStreamContext

from services.reconciler import metrics
from shared.bus.provision import IMAGES_MAX_MSG_BYTES
from shared.fence.keys import Key
from shared.fence.state import KeyState, decode_state
from shared.subjects import Subjects

log = logging.getLogger("vmfence.reconciler.images")

IMAGE_SCHEMA = 1
MAX_IMAGE_BYTES = 256 * 1024 * 1024  # decompressed; a larger image is refused unread (a bomb, or not ours)
PUT_TIMEOUT_S = 10.0

Row = tuple[str, int, bytes]  # key, the stream sequence of its last folded entry, its encoded state


class PartitionImage(msgspec.Struct, frozen=True, kw_only=True):
    """Every key of one partition at ``watermark``: each log entry of the partition at or below it
    is folded into the rows (as a snapshot's watermark says)."""

    v: int = IMAGE_SCHEMA
    stream: str  # the log stream's identity: a recreated bus makes every image stale
    partition: int
    watermark: int
    writer: str  # who put it (diagnostics)
    rows: list[Row]


class ImageRefused(Exception):
    """Not an image this reconciler can use; the reason says why."""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(PartitionImage)


def encode_image(image: PartitionImage) -> bytes:
    return zlib.compress(_encoder.encode(image), 1)


def decode_image(data: bytes, *, max_bytes: int = MAX_IMAGE_BYTES) -> PartitionImage:
    """The image in ``data``, decompressed to at most ``max_bytes``; ``ImageRefused`` otherwise."""
    inflater = zlib.decompressobj()
    try:
        raw = inflater.decompress(data, max_bytes)
    except zlib.error as exc:
        raise ImageRefused(f"not compressed as an image: {exc}") from exc
    if inflater.unconsumed_tail:
        raise ImageRefused(f"larger than {max_bytes} bytes decompressed")
    if not inflater.eof:
        raise ImageRefused("truncated")
    try:
        image = _decoder.decode(raw)
    except msgspec.DecodeError as exc:  # ValidationError included
        raise ImageRefused(f"undecodable: {exc}") from exc
    if image.v != IMAGE_SCHEMA:
        raise ImageRefused(f"schema {image.v}; this reconciler reads {IMAGE_SCHEMA}")
    return image


class ImageStore:
    """Puts and gets the images of one stream identity's partitions."""

    def __init__(self, js: JetStreamContext, subjects: Subjects, *, stream_identity: str, writer: str,
                 max_msg_bytes: int = IMAGES_MAX_MSG_BYTES) -> None:
        self.js = js
        self.subjects = subjects
        self.stream_identity = stream_identity
        self.writer = writer
        self.max_msg_bytes = max_msg_bytes

    async def put(self, p: int, rows: list[Row], watermark: int) -> bool:
        """Put partition ``p``'s image; False when it is too large for one message (logged)."""
        data = encode_image(PartitionImage(stream=self.stream_identity, partition=p, watermark=watermark,
                                           writer=self.writer, rows=rows))
        if len(data) > self.max_msg_bytes:
            log.warning("partition image not put: %d bytes compressed, over %d; its next owner reads the log",
                        len(data), self.max_msg_bytes, extra={"partition": p})
            metrics.PARTITION_IMAGES.labels("too_large").inc()
            return False
        await self.js.publish(self.subjects.image(p), data, timeout=PUT_TIMEOUT_S)
        metrics.PARTITION_IMAGES.labels("put").inc()
        return True

    async def get(self, p: int) -> tuple[int, dict[str, tuple[KeyState, int]]] | None:
        """Partition ``p``'s latest image as (watermark, rows); None when there is none, the bus
        did not answer, or it is not one to use (logged and counted)."""
        try:
            msg = await self.js.get_last_msg(self.subjects.stream_images, self.subjects.image(p))
        except nats.js.errors.NotFoundError:
            return None
        except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as exc:
            log.warning("partition image not read: %r; the log is read instead", exc, extra={"partition": p})
            return None
        try:
            return self._rows(p, decode_image(msg.data or b""))
        except ImageRefused as exc:
            log.warning("partition image ignored: %s", exc, extra={"partition": p})
            metrics.PARTITION_IMAGES.labels("refused").inc()
            return None

    def _rows(self, p: int, image: PartitionImage) -> tuple[int, dict[str, tuple[KeyState, int]]]:
        if image.stream != self.stream_identity:
            raise ImageRefused(f"of another stream ({image.stream!r}, this one is {self.stream_identity!r})")
        if image.partition != p:
            raise ImageRefused(f"of partition {image.partition}, stored as {p}'s")
        rows: dict[str, tuple[KeyState, int]] = {}
        for key, seq, blob in image.rows:
            try:
                if self.subjects.partition(Key.parse(key)) != p:
                    raise ImageRefused(f"a row of key {key!r}, which is not in partition {p}")
                state = decode_state(blob)
            except (ValueError, msgspec.DecodeError) as exc:
                raise ImageRefused(f"row {key!r}: {exc}") from exc
            if state.key != key or seq < 0:
                raise ImageRefused(f"row {key!r} holds another key's state, or no sequence")
            rows[key] = (state, seq)
        metrics.PARTITION_IMAGES.labels("read").inc()
        return image.watermark, rows
