"""`vmfence decisions` as a person reads it: every fence visible whatever its uid's first character,
a header naming the columns, no line wrapped, `--since` as a sequence or a time with and without
`--follow`, and one clear line (never a traceback) for a mistake or a closed pipe."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import msgspec
import pytest

from services.testbed.natsserver import NatsServer
from shared.bus.append import fenced_append
from shared.bus.connect import Bus
from shared.bus.logstream import Since, parse_since
from shared.bus.provision import StreamsConfig, provision
from shared.fence.keys import Key
from shared.fence.schema import Admitted, Fence, LogEntry, Skipped, Spec, encode
from shared.subjects import Subjects
from tests.cli.test_replay import ROOT, vmfence

# one uid of each shape: digit-first, letter-first (rich took "[e1b2…]" for markup and dropped it),
# and one that looks like a style tag outright
UIDS = ("532cbacd-0000-4000-8000-000000000001", "e1b2c3d4-0000-4000-8000-000000000002", "red-bold-0003")
LONG = "a-rather-long-pod-name-that-makes-every-line-wider-than-eighty-columns"


async def _log(url: str) -> None:
    subjects = Subjects()
    bus = await Bus.open(url, name="test", subjects=subjects)
    try:
        await provision(bus.js, subjects, StreamsConfig())
        for i, uid in enumerate(UIDS):
            key = Key("pod", "shop", f"{LONG}-{i}")
            decisions = [Admitted(Fence(str(key), uid, 1), Spec(), None, 1)]
            if i == 2:
                decisions.append(Skipped("superseded", uid="old-uid", detail="a [bold]late[/bold] probe"))
            entry = LogEntry(str(key), 1, decisions, writer="rec-1")
            await fenced_append(bus.js, subjects.log(key), encode(entry), expected_last_subject_seq=0,
                                msg_id=f"{key}#1", stream=subjects.stream_log)
    finally:
        await bus.close()


async def test_text_shows_every_fence_under_a_header_without_wrapping(nats_server: NatsServer) -> None:
    await _log(nats_server.url)
    out = await asyncio.to_thread(vmfence, "decisions", "--nats-url", nats_server.url)
    assert out.returncode == 0, out.stderr
    header, *rows = out.stdout.splitlines()
    assert header.split() == ["SEQ", "TIME", "KEY", "FENCE", "DECISION", "REASON"]
    assert len(rows) == 4  # three admissions and one skip
    for uid in UIDS:
        assert f"{uid[:8]}/e1" in out.stdout, f"the fence of {uid} is missing: {out.stdout}"
    for i in range(3):  # each key whole on one line, lines far wider than 80 columns
        assert any(f"shop/{LONG}-{i}#1" in row and len(row) > 80 for row in rows)
    skip = next(r for r in rows if "skipped" in r)
    assert "superseded" in skip and "a [bold]late[/bold] probe" in skip and "uid old-uid" in skip
    assert all("T" in r.split()[1] and r.split()[1].endswith("Z") for r in rows)  # a UTC time on every row


async def test_json_carries_the_columns(nats_server: NatsServer) -> None:
    await _log(nats_server.url)
    out = await asyncio.to_thread(vmfence, "decisions", "--nats-url", nats_server.url, "--json")
    assert out.returncode == 0, out.stderr
    records = [msgspec.json.decode(line) for line in out.stdout.splitlines()]
    assert [r["seq"] for r in records] == [1, 2, 3]
    assert {row["FENCE"] for r in records for row in r["rows"]} >= {f"{u[:8]}/e1" for u in UIDS}
    assert all(r["time"].endswith("Z") and r["ts"] > 0 for r in records)


async def test_since_a_sequence_or_a_time_with_and_without_follow(nats_server: NatsServer) -> None:
    await _log(nats_server.url)
    url = nats_server.url
    by_seq = await asyncio.to_thread(vmfence, "decisions", "--nats-url", url, "--since", "2", "--json")
    assert [msgspec.json.decode(x)["seq"] for x in by_seq.stdout.splitlines()] == [2, 3]
    recent = await asyncio.to_thread(vmfence, "decisions", "--nats-url", url, "--since", "10m", "--json")
    assert len(recent.stdout.splitlines()) == 3
    future = await asyncio.to_thread(vmfence, "decisions", "--nats-url", url, "--since", "2999-01-01T00:00:00Z")
    assert future.returncode == 0 and len(future.stdout.splitlines()) == 1  # the header alone
    # following from a sequence: the stored entries from there, then it waits for more
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.cli", "decisions", "--nats-url", url, "--since", "3", "--follow", "--json",
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT,
    )
    try:
        assert proc.stdout is not None
        first = await asyncio.wait_for(proc.stdout.readline(), 30)
        assert msgspec.json.decode(first)["seq"] == 3
    finally:
        proc.kill()
        await proc.wait()


async def test_a_mistake_or_a_closed_pipe_is_one_line_not_a_traceback(nats_server: NatsServer) -> None:
    await _log(nats_server.url)
    bad_key = await asyncio.to_thread(vmfence, "decisions", "--nats-url", nats_server.url, "--key", "nonsense")
    assert bad_key.returncode == 2 and "Traceback" not in bad_key.stderr
    assert bad_key.stderr.strip().startswith("vmfence decisions:") and len(bad_key.stderr.strip().splitlines()) == 1
    bad_since = await asyncio.to_thread(vmfence, "decisions", "--nats-url", nats_server.url, "--since", "soon")
    assert bad_since.returncode == 2 and "expected a stream sequence" in bad_since.stderr
    shell = f"{sys.executable} -m services.cli decisions --nats-url {nats_server.url} --json | head -1"
    piped = await asyncio.to_thread(subprocess.run, ["bash", "-o", "pipefail", "-c", shell],
                                    capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert len(piped.stdout.splitlines()) == 1 and "Traceback" not in piped.stderr, piped.stderr


@pytest.mark.parametrize(
    ("text", "want"),
    [("1", Since(seq=1)), ("42", Since(seq=42)), ("90s", Since(time_s=1000.0 - 90)), ("10m", Since(time_s=400.0)),
     ("2026-12-01T20:00:00Z", Since(time_s=1796155200.0)),
     ("2026-12-01T21:00:00+01:00", Since(time_s=1796155200.0))],
)
def test_parse_since(text: str, want: Since) -> None:
    assert parse_since(text, now_s=1000.0) == want


@pytest.mark.parametrize("text", ["", "soon", "-5", "10x", "2026-12-01T20:00:00", "9" * 5000])
def test_parse_since_refuses_with_the_accepted_forms(text: str) -> None:
    with pytest.raises(ValueError, match="--since"):
        parse_since(text, now_s=time.time())
