"""Reading an export a chunk at a time gives exactly the records of reading it whole, across chunk
boundaries that cut records anywhere, and a truncated or foreign file is a clear error."""

from __future__ import annotations

import io

import pytest

import shared.bus.logstream as logstream
from shared.bus.logstream import EXPORT_MAGIC, Record, encode_record, iter_export, iter_export_stream
from shared.fence.schema import Admitted, Fence, LogEntry, Skipped, Spec


def _export(n: int) -> bytes:
    recs = [Record(i + 1, LogEntry(f"ns/p{i % 7}", i // 7 + 1,
                                   [Admitted(Fence(f"ns/p{i % 7}", f"u{i}", i + 1), Spec(), None, i),
                                    Skipped("superseded", uid="x" * (i % 50))]), float(i)) for i in range(n)]
    return EXPORT_MAGIC + b"".join(encode_record(r) for r in recs)


@pytest.mark.parametrize("chunk", [1, 7, 64, 1 << 20])
def test_the_stream_reads_what_the_whole_file_holds(monkeypatch: pytest.MonkeyPatch, chunk: int) -> None:
    data = _export(300)
    monkeypatch.setattr(logstream, "EXPORT_CHUNK_BYTES", chunk)
    assert list(iter_export_stream(io.BytesIO(data))) == list(iter_export(data))


def test_a_truncated_or_foreign_stream_is_a_clear_error() -> None:
    data = _export(5)
    with pytest.raises(ValueError, match="truncated"):
        list(iter_export_stream(io.BytesIO(data[:-3])))
    with pytest.raises(ValueError, match="not a vmfence export"):
        list(iter_export_stream(io.BytesIO(b"PK\x03\x04" + data)))
    assert list(iter_export_stream(io.BytesIO(EXPORT_MAGIC))) == []


@pytest.mark.parametrize("release", [1, 4096, 1 << 24])
def test_a_mapped_file_reads_what_the_whole_file_holds(tmp_path, monkeypatch: pytest.MonkeyPatch,
                                                      release: int) -> None:
    """A regular file is mapped rather than read (and its pages handed back as it goes): the same
    records, whichever page the hand-back falls on."""
    data = _export(300)
    path = tmp_path / "log.export"
    path.write_bytes(data)
    monkeypatch.setattr(logstream, "MAPPED_RELEASE_BYTES", release)
    with open(path, "rb") as f:
        assert logstream._mapped(f) is not None
        assert list(iter_export_stream(f)) == list(iter_export(data))


def test_a_truncated_mapped_file_is_a_clear_error(tmp_path) -> None:
    path = tmp_path / "log.export"
    path.write_bytes(_export(5)[:-3])
    with open(path, "rb") as f, pytest.raises(ValueError, match="truncated"):
        list(iter_export_stream(f))
    path.write_bytes(EXPORT_MAGIC)
    with open(path, "rb") as f:
        assert list(iter_export_stream(f)) == []
