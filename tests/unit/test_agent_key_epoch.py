"""The agent's side of detecting a lost log tail no reconciler saw: every answer carries the key's
mark, so a refusal by the mark alone (no VM of that name to name as owner), or the answer to a
remove the cut log re-decided, still shows the reconciler an epoch above everything its log knows."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from services.agent.executor import Executor
from services.agent.ledger import Ledger
from services.agent.runtime.sim import SimDriver
from shared.fence.schema import NO_INCARNATION, SURVEY_VM_ID, Command, Fence, Spec

KEY = "default/web-1"


async def test_every_answer_carries_the_keys_mark(tmp_path: Path) -> None:
    ledger = Ledger(str(tmp_path / "ledger.sqlite3"))
    await ledger.open()
    driver = SimDriver(state_dir=str(tmp_path / "rt"), vnc_displays=range(10, 20))
    await driver.open()
    ex = Executor(ledger=ledger, driver=driver, host="h1", snapshot_dir=str(tmp_path / "snap"), vnc=False)
    try:
        newer = Fence(KEY, "u3", 3)  # decided in a tail the log then lost
        made, _ = await ex.execute(Command("c-new", "create", newer, "h1", "web-1-u3-2", Spec()))
        assert made.outcome == "ok" and made.key_epoch == 3
        # the cut log admits u3 again at epoch 2 and creates under another VM name
        again, _ = await ex.execute(Command("c-old", "create", Fence(KEY, "u3", 2), "h1", "web-1-u3-1", Spec()))
        assert again.outcome == "fenced" and again.found == [] and again.key_epoch == 3
        stored, replayed = await ex.execute(Command("c-old", "create", Fence(KEY, "u3", 2), "h1", "web-1-u3-1", Spec()))
        assert replayed and stored.key_epoch == 3
        # a remove never raises the mark, and its answer still carries it
        gone, _ = await ex.execute(Command("c-rm", "remove", Fence(KEY, "u1", 1), "h1", "web-1-u1-1", Spec()))
        assert gone.outcome in ("ok", "not_found") and gone.key_epoch == 3
    finally:
        await driver.close()
        await ledger.close()


async def _executor(tmp_path: Path) -> tuple[Executor, Ledger, SimDriver]:
    ledger = Ledger(str(tmp_path / "ledger.sqlite3"))
    await ledger.open()
    driver = SimDriver(state_dir=str(tmp_path / "rt"), vnc_displays=range(10, 20))
    await driver.open()
    ex = Executor(ledger=ledger, driver=driver, host="h1", snapshot_dir=str(tmp_path / "snap"), vnc=False)
    return ex, ledger, driver


async def test_the_mark_names_its_incarnation_and_refuses_another_at_that_epoch(tmp_path: Path) -> None:
    """An unseen cut can give one epoch to two uids (the lost tail's u2, the cut log's u5): the
    host that saw u2 at epoch 2 refuses u5 at epoch 2 and says whose epoch it is."""
    ex, ledger, driver = await _executor(tmp_path)
    try:
        made, _ = await ex.execute(Command("c-u2", "create", Fence(KEY, "u2", 2), "h1", "web-1-u2-1", Spec()))
        assert made.outcome == "ok" and (made.key_epoch, made.key_uid) == (2, "u2")
        other, _ = await ex.execute(Command("c-u5", "create", Fence(KEY, "u5", 2), "h1", "web-1-u5-1", Spec()))
        assert other.outcome == "fenced" and (other.key_epoch, other.key_uid) == (2, "u2")
        assert await driver.inspect("web-1-u5-1") is None
        # the same incarnation at that epoch still works (a restart of its VM)
        same, _ = await ex.execute(Command("c-u2b", "start", Fence(KEY, "u2", 2), "h1", "web-1-u2-1", Spec()))
        assert same.outcome == "ok"
        # a survey answer is a question about now: a redelivered one is answered afresh
        survey = Command("c-s", "survey", Fence(KEY, "u2", 2), "h1", SURVEY_VM_ID, Spec())
        first, _ = await ex.execute(survey)
        await ex.execute(Command("c-rm", "remove", Fence(KEY, "u2", 2), "h1", "web-1-u2-1", Spec()))
        again, replayed = await ex.execute(survey)
        assert [i.vm_id for i in first.found] == ["web-1-u2-1"] and again.found == [] and not replayed
    finally:
        await driver.close()
        await ledger.close()


async def test_an_epoch_surveyed_for_no_incarnation_lets_nothing_run_at_it(tmp_path: Path) -> None:
    ex, ledger, driver = await _executor(tmp_path)
    try:
        surveyed, _ = await ex.execute(Command("c-s", "survey", Fence(KEY, "", 3), "h1", SURVEY_VM_ID, Spec()))
        assert (surveyed.key_epoch, surveyed.key_uid) == (3, NO_INCARNATION)
        late, _ = await ex.execute(Command("c-late", "create", Fence(KEY, "u6", 3), "h1", "web-1-u6-1", Spec()))
        assert late.outcome == "fenced" and late.key_uid == NO_INCARNATION
        nxt, _ = await ex.execute(Command("c-next", "create", Fence(KEY, "u7", 4), "h1", "web-1-u7-1", Spec()))
        assert nxt.outcome == "ok" and (nxt.key_epoch, nxt.key_uid) == (4, "u7")
    finally:
        await driver.close()
        await ledger.close()


async def test_a_surveys_mark_is_durable_before_its_answer_and_the_answer_is_not_stored(tmp_path: Path) -> None:
    """What a survey promises (no command of the key at or below its fence makes a VM here) must
    survive the agent's restart; its answer is never read back (a redelivery is answered afresh), so
    it costs no write of its own."""
    ex, ledger, driver = await _executor(tmp_path)
    try:
        surveyed, _ = await ex.execute(Command("c-s", "survey", Fence(KEY, "u4", 4), "h1", SURVEY_VM_ID, Spec()))
        assert surveyed.outcome == "ok" and await ledger.result("c-s") is None
    finally:
        await driver.close()
        await ledger.close()
    ex, ledger, driver = await _executor(tmp_path)
    try:
        assert (ledger.key_mark(KEY), ledger.key_mark_uid(KEY)) == (4, "u4")
        late, _ = await ex.execute(Command("c-late", "create", Fence(KEY, "u3", 3), "h1", "web-1-u3-1", Spec()))
        assert late.outcome == "fenced"
    finally:
        await driver.close()
        await ledger.close()


async def test_a_ledger_from_before_marks_named_their_uid_opens_with_unknown_uids(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite3"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE key_marks (key TEXT PRIMARY KEY, epoch INTEGER NOT NULL)")
    db.execute("INSERT INTO key_marks VALUES (?, 2)", (KEY,))
    db.commit()
    db.close()
    ledger = Ledger(str(path))
    await ledger.open()
    try:
        assert (ledger.key_mark(KEY), ledger.key_mark_uid(KEY)) == (2, "")
        await ledger.raise_key_mark(KEY, 2, "u2")  # an unknown uid is filled in, once
        await ledger.raise_key_mark(KEY, 2, "u9")
        assert ledger.key_mark_uid(KEY) == "u2"
    finally:
        await ledger.close()
    reopened = Ledger(str(path))
    await reopened.open()
    try:
        assert (reopened.key_mark(KEY), reopened.key_mark_uid(KEY)) == (2, "u2")
    finally:
        await reopened.close()
