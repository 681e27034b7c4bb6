"""An idle key is held packed and comes back exactly as it was; a key with anything in flight never is."""

from __future__ import annotations

import asyncio

from services.reconciler.keytable import KeySlot, pack_state, unpack_encoded
from shared.fence.schema import Admitted, Bound, Command, Commanded, Done, Fence, Placed, Spec, TimerArmed
from shared.fence.state import KeyState, encode_state, fold_all


def bound_state(key: str = "shop/cart.1", uid: str = "uid-1") -> KeyState:
    f = Fence(key, uid, 1)
    cmd = Command("c1", "create", f, "host-a", "vm-1")
    s = fold_all(
        KeyState(key=key),
        [Admitted(f, Spec(cpus=2)), Placed(f, "vm-1", "host-a"), Commanded(cmd), Done("c1", "ok"),
         Bound(f, "vm-1", "host-a", "c1", ip="10.0.0.7")],
    )  # fmt: skip
    s.n = 3
    return s


def test_an_idle_slot_is_packed_and_unpacks_to_the_same_state() -> None:
    state = bound_state()
    before = encode_state(state)
    slot = KeySlot(state, 42)
    slot.release_idle()
    assert slot.packed and len(pack_state(state)) < len(before)
    assert slot.encoded() == before  # snapshots get plain encode_state bytes
    assert encode_state(slot.peek()) == before and slot.packed  # a look does not unpack
    assert encode_state(slot.state) == before and not slot.packed
    slot.state.n += 1  # the unpacked state is the slot's own: changes stick
    assert slot.state.n == 4 and slot.last_seq == 42


def test_unusual_states_round_trip() -> None:
    for state in (KeyState(key="vm:ns/odd.name"), bound_state("ns/" + "x" * 300, "u" * 100)):
        assert unpack_encoded(pack_state(state)) == encode_state(state)


async def test_a_slot_with_work_in_flight_is_never_packed() -> None:
    state = bound_state()
    state.outbox["t1"] = TimerArmed(state.cur.fence, "t1", 5.0, "restart")  # type: ignore[union-attr]
    slot = KeySlot(state)
    slot.release_idle()
    assert not slot.packed  # a pending timer (or command, write, confirm) keeps it live

    slot = KeySlot(bound_state())
    async with slot.lock:
        slot.release_idle()
        assert not slot.packed  # an input is being handled
    waiter_started = asyncio.Event()

    async def waiter() -> None:
        waiter_started.set()
        async with slot.lock:
            pass

    async with slot.lock:
        task = asyncio.create_task(waiter())
        await waiter_started.wait()
        await asyncio.sleep(0)
    slot.release_idle()
    assert not slot.packed  # another input waits for the key
    await task
    slot.release_idle()
    assert slot.packed
