"""Fixed regressions for the agent's own fence checks (issue 16), through the agent's stable
interface only: commands on the bus in, results on the report subjects out, the sim runtime's
history and the ledger's owner as oracles. Each situation is one where the checked-for command
passes every other check (the key mark, the tombstones), so the check under test is the only
thing that refuses it; each was seen to pass a mutant without that check."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from nats.aio.client import Client

from services.agent.config import AgentConfig
from services.agent.ledger import LEDGER_FILE
from services.agent.runtime import VMSpec
from services.agent.runtime.sim import SimDriver
from services.agent.service import Agent
from shared.fence.schema import SURVEY_VM_ID, Command, CommandResult, Fence, Input, VMGone

from .conftest import Reports, command, fence, send, sim_driver

EFFECT_OPS = ("create", "start", "stop", "remove", "snapshot", "restore")


def is_result(cid: str) -> Callable[[Input], bool]:
    return lambda i: isinstance(i, CommandResult) and i.command_id == cid


async def run(nc: Client, reports: Reports, cmd: Command) -> CommandResult:
    await send(nc, cmd)
    r = await reports.wait(is_result(cmd.id))
    assert isinstance(r, CommandResult)
    return r


def effects_on(driver: SimDriver, vm_id: str, since: int) -> list[str]:
    """Runtime effects on ``vm_id`` recorded after position ``since`` of the sim's history."""
    return [op.op for op in driver.history[since:] if op.vm_id == vm_id and op.op in EFFECT_OPS]


async def test_a_wake_without_a_snapshot_is_refused_before_the_runtime_is_asked(
    nc: Client, reports: Reports, make_config: Callable[..., AgentConfig]
) -> None:
    """Rule 10: waking restores from a snapshot, never a blank VM. The reconciler never sends a
    wake without one; the agent refuses it all the same, without asking the runtime anything."""
    cfg = make_config()
    driver = sim_driver(cfg)
    async with Agent(cfg, driver=driver) as agent:
        for i, snapshot in enumerate(("", None)):
            vm_id = f"w-{i}"
            wake = command("wake", vm_id, fence(1), snapshot=snapshot)
            r = await run(nc, reports, wake)
            assert r.outcome == "failed" and r.error is not None and "snapshot" in r.error, r
            assert effects_on(driver, vm_id, 0) == [], "the runtime was asked to restore without a snapshot"
            assert agent.ledger.vm(vm_id) is None and driver.all_vms() == []


async def test_a_newer_fences_non_adopt_op_on_a_predecessors_vm_is_fenced(
    nc: Client, reports: Reports, make_config: Callable[..., AgentConfig]
) -> None:
    """Rule 4: only ``adopt`` moves a VM to a newer incarnation (after inspecting it). A newer
    fence of the same key passes the key mark, so the ledger's owner check alone must refuse its
    ``create``/``start``/``hibernate``/``wake`` of the predecessor's VM — and the refusal names
    the real owner."""
    cfg = make_config()
    old, new = fence(1), fence(2)
    driver = sim_driver(cfg)
    async with Agent(cfg, driver=driver) as agent:
        assert (await run(nc, reports, command("create", "n-1", old))).outcome == "ok"
        since = len(driver.history)
        for op in ("create", "start", "hibernate", "wake"):
            cmd = command(op, "n-1", new, snapshot="/nonexistent/n-1.snap" if op == "wake" else None)
            r = await run(nc, reports, cmd)
            assert r.outcome == "fenced", (op, r)
            assert r.fence == new and [(i.vm_id, i.fence) for i in r.found] == [("n-1", old)], (op, r)
            assert agent.ledger.owner("n-1") == old, op
        assert effects_on(driver, "n-1", since) == [], "a newer fence acted on its predecessor's VM"
        assert driver.running_vms() == ["n-1"]
        # the newer fence may still collect it; it is gone for good afterwards
        assert (await run(nc, reports, command("remove", "n-1", new))).outcome == "ok"
        assert driver.all_vms() == [] and agent.ledger.owner("n-1") is None


async def test_a_vm_of_another_key_is_never_touched(
    nc: Client, reports: Reports, make_config: Callable[..., AgentConfig]
) -> None:
    """Rule 4 across keys: a command whose fence belongs to another key (its epoch above the
    owner's, its own key's mark unset here) is refused for every op — start, create, hibernate,
    wake, adopt, remove — and the VM keeps its owner and keeps running."""
    cfg = make_config()
    owner = fence(1)
    stranger = Fence("default/other", "uid-other", 5)
    driver = sim_driver(cfg)
    async with Agent(cfg, driver=driver) as agent:
        assert (await run(nc, reports, command("create", "k-1", owner))).outcome == "ok"
        since = len(driver.history)
        for op in ("start", "create", "hibernate", "wake", "adopt", "remove"):
            cmd = command(op, "k-1", stranger, snapshot="/nonexistent/k-1.snap" if op == "wake" else None)
            r = await run(nc, reports, cmd)
            assert r.outcome == "fenced", (op, r)
            assert [(i.vm_id, i.fence) for i in r.found] == [("k-1", owner)], (op, r)
            assert agent.ledger.owner("k-1") == owner, op
        assert effects_on(driver, "k-1", since) == [], "another key's command acted on the VM"
        assert driver.running_vms() == ["k-1"]
        assert {x.fence for x in await agent.ledger.reservations("k-1")} == {owner}


async def test_a_resent_survey_of_an_older_epoch_never_lowers_the_keys_mark(
    nc: Client, reports: Reports, make_config: Callable[..., AgentConfig]
) -> None:
    """Rule 4 by the key's mark: a survey is exempt from the mark's refusal (it changes no VM), and
    a round re-sent from an old outbox carries an older epoch. Answering it must not lower the mark,
    or a stale create of that older epoch — for a VM name nobody owns yet, so no owner check can
    refuse it — would make a second VM for the key."""
    cfg = make_config()
    driver = sim_driver(cfg)
    async with Agent(cfg, driver=driver) as agent:
        assert (await run(nc, reports, command("create", "m-3", fence(3)))).outcome == "ok"
        survey = await run(nc, reports, command("survey", SURVEY_VM_ID, fence(1)))
        assert survey.outcome == "ok" and survey.key_epoch == 3
        assert [(i.vm_id, i.fence) for i in survey.found] == [("m-3", fence(3))]
        stale = await run(nc, reports, command("create", "m-2", fence(2)))
        assert stale.outcome == "fenced" and stale.key_epoch == 3, stale
        assert agent.ledger.key_mark(fence(1).key) == 3
        assert driver.all_vms() == ["m-3"]


async def test_a_rival_at_the_owners_epoch_never_collects_or_adopts_the_vm(
    nc: Client, reports: Reports, make_config: Callable[..., AgentConfig]
) -> None:
    """Rule 4: at the owner's epoch only the owner's uid may touch the VM. A remove is exempt from
    the key's mark (cleanup carries the owner's own, possibly old, fence), so the owner check alone
    refuses a remove under another uid at that epoch; an adopt or a look under it likewise."""
    cfg = make_config()
    owner, rival = fence(2, uid="uid-a"), fence(2, uid="uid-b")
    driver = sim_driver(cfg)
    async with Agent(cfg, driver=driver) as agent:
        assert (await run(nc, reports, command("create", "r-1", owner))).outcome == "ok"
        since = len(driver.history)
        for op in ("remove", "adopt", "start"):
            r = await run(nc, reports, command(op, "r-1", rival))
            assert r.outcome == "fenced", (op, r)
            assert [(i.vm_id, i.fence) for i in r.found] == [("r-1", owner)], (op, r)
        assert effects_on(driver, "r-1", since) == [] and driver.running_vms() == ["r-1"]
        assert agent.ledger.owner("r-1") == owner


def _lose_ledger(cfg: AgentConfig) -> None:
    """The agent's data dir is gone (a new disk, a wiped volume): the runtime keeps its VMs."""
    base = Path(cfg.data_dir) / LEDGER_FILE
    for suffix in ("", "-wal", "-shm"):
        Path(f"{base}{suffix}").unlink(missing_ok=True)


async def test_with_its_ledger_lost_the_vms_labels_still_fence_it(
    nc: Client, reports: Reports, make_config: Callable[..., AgentConfig]
) -> None:
    """Rule 4 without the ledger: a restarted agent whose ledger (owners, key marks) was lost still
    finds each VM's owner fence on its runtime labels, and refuses an adopt, a create or a remove
    under an older fence there — the only check left once the key's mark is gone too."""
    cfg = make_config()
    owner = fence(3)
    async with Agent(cfg, driver=sim_driver(cfg)):
        assert (await run(nc, reports, command("create", "l-1", owner))).outcome == "ok"
    _lose_ledger(cfg)
    driver = sim_driver(cfg)
    async with Agent(cfg, driver=driver) as agent:
        assert agent.ledger.owner("l-1") is None and agent.ledger.key_mark(owner.key) == 0
        assert driver.running_vms() == ["l-1"]
        since = len(driver.history)
        for op, older in (("adopt", fence(1)), ("create", fence(2)), ("remove", fence(1))):
            r = await run(nc, reports, command(op, "l-1", older))
            assert r.outcome == "fenced", (op, r)
            assert r.error is not None and "older than the owner" in r.error, (op, r)
        assert effects_on(driver, "l-1", since) == [], "an older fence acted on the VM its labels say is newer"
        assert driver.running_vms() == ["l-1"] and agent.ledger.owner("l-1") is None
        # its owner may still collect it
        assert (await run(nc, reports, command("remove", "l-1", owner))).outcome == "ok"
        assert driver.all_vms() == []


async def test_a_buried_vm_id_the_runtime_shows_again_is_never_adopted(
    nc: Client, reports: Reports, make_config: Callable[..., AgentConfig]
) -> None:
    """Rule 4/8: the runtime lost a VM and the agent buried its vm_id (the reconciler releases it
    and makes a new one); if the runtime then shows a VM under that name again, an adopt — which
    asks the runtime first — still refuses it: a vm_id is never brought back."""
    cfg = make_config()
    driver = sim_driver(cfg)
    async with Agent(cfg, driver=driver) as agent:
        assert (await run(nc, reports, command("create", "b-1", fence(1)))).outcome == "ok"
        driver.lose_vm("b-1")
        await agent.inventory()  # the inventory's look (or the prober) notices it: buried as lost
        await reports.wait(lambda i: isinstance(i, VMGone) and i.vm_id == "b-1")
        assert agent.ledger.tombstone("b-1") is not None and agent.ledger.owner("b-1") is None
        await driver.create(VMSpec(vm_id="b-1"))  # the runtime shows a VM of that name again
        r = await run(nc, reports, command("adopt", "b-1", fence(2)))
        assert r.outcome == "fenced", r
        assert agent.ledger.owner("b-1") is None, "a buried vm_id was adopted"


async def test_an_adopt_whose_inspect_fails_is_inconclusive_never_a_failure(
    nc: Client, reports: Reports, make_config: Callable[..., AgentConfig]
) -> None:
    """Rule 8: an adopt moves ownership only after the runtime confirms the VM. An inspect that fails
    says nothing about the VM: the answer is ``inconclusive`` (the reconciler asks again), never
    ``failed`` (which releases the VM and makes a second one beside it)."""
    cfg = make_config()
    old, new = fence(1), fence(2)
    driver = sim_driver(cfg)
    async with Agent(cfg, driver=driver) as agent:
        assert (await run(nc, reports, command("create", "i-1", old))).outcome == "ok"
        driver.faults.fail("inspect", vm_id="i-1")
        r = await run(nc, reports, command("adopt", "i-1", new))
        assert r.outcome == "inconclusive", r
        assert agent.ledger.owner("i-1") == old
        again = await run(nc, reports, command("adopt", "i-1", new, cid="adopt-again"))
        assert again.outcome == "ok" and agent.ledger.owner("i-1") == new
        assert driver.running_vms() == ["i-1"]
