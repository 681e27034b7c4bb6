"""The agent's side of detecting a lost log tail no reconciler saw: every answer carries the key's
mark, so a refusal by the mark alone (no VM of that name to name as owner), or the answer to a
remove the cut log re-decided, still shows the reconciler an epoch above everything its log knows."""

from __future__ import annotations

from pathlib import Path

from services.agent.executor import Executor
from services.agent.ledger import Ledger
from services.agent.runtime.sim import SimDriver
from shared.schema import Command, Fence, Spec

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
