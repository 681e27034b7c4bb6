"""Random interleavings of everything the world can do; the audit and the agents' own records are
the oracles.

How many examples, and from which seed, is the active hypothesis profile's (tests/conftest.py: ci,
derandomized, by default; ``make property-long`` for many more): the counts below scale with it."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.testbed.world import World
from shared.fence.schema import Spec

# the profile is loaded before test modules are collected (conftest, then --hypothesis-profile)
EXAMPLES = settings.default.max_examples
CHURN_EXAMPLES = max(1, EXAMPLES * 3 // 5)

ACTIONS = (
    "create", "create_adopt", "delete", "force_recreate", "force_delete_unobserved", "hibernate",
    "wake", "stale", "crash", "lose", "probe", "inventory", "deliver", "deliver", "deliver",
    "deliver", "deliver", "duplicate", "drop_report",
)


def _run(data: st.DataObject, world: World, steps: int) -> None:
    for _ in range(steps):
        action = data.draw(st.sampled_from(ACTIONS))
        key = data.draw(st.sampled_from(world.keys))
        match action:
            case "create":
                world.create(key)
            case "create_adopt":
                world.create(key, Spec(on_recreate="adopt"))
            case "delete":
                world.delete(key)
            case "force_recreate":
                world.force_delete(key)
                world.create(key, Spec(on_recreate=data.draw(st.sampled_from(["replace", "adopt"]))))
            case "force_delete_unobserved":
                world.force_delete(key, observed=False)
                world.create(key)
            case "hibernate":
                world.set_hibernate(key, True)
            case "wake":
                world.set_hibernate(key, False)
            case "stale":
                world.stale_replay(key, data.draw(st.integers(0, 4)))
            case "crash":
                world.crash_vm(key)
            case "lose":
                world.lose_vm(key)
            case "probe":
                world.probe(key, data.draw(st.booleans()))
            case "inventory":
                world.inventory()
            case "deliver":
                world.deliver(data.draw(st.integers(0, 1000)))
            case "duplicate":
                world.deliver(data.draw(st.integers(0, 1000)), duplicate=True)
            case "drop_report":
                world.deliver(data.draw(st.integers(0, 1000)), drop_report=True)


def _check_quiescent(world: World) -> None:
    world.settle()
    assert world.max_vms_per_key <= 1, "two VMs for one key at once (agents' own records)"
    report = world.audit()
    assert report.clean, "\n".join(f"{v.key}#{v.n} {v.rule}: {v.message}" for v in report.violations)
    for key in world.keys:
        pod = world.pods.get(key)
        vms = world.vms_of(key)
        if pod is None:
            assert vms == [], f"leaked VM for deleted {key}: {vms}"
        else:
            state = world.states[key]
            cur = state.cur
            assert cur is not None and cur.fence.uid == pod.uid, f"{key}: live pod not current"
            expected = 0 if (pod.spec.hibernate or cur.phase in ("Failed", "Succeeded")) else 1
            assert len(vms) == expected, f"{key}: {len(vms)} VMs, expected {expected}"
            for vm in vms:
                assert vm.owner == cur.fence


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_interleavings_keep_every_invariant(data: st.DataObject) -> None:
    world = World(keys=2)
    _run(data, world, data.draw(st.integers(5, 80)))
    _check_quiescent(world)


@settings(max_examples=CHURN_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_fast_churn_of_one_key(data: st.DataObject) -> None:
    world = World(keys=1)
    key = world.keys[0]
    world.create(key)
    for _ in range(data.draw(st.integers(1, 12))):
        world.force_delete(key, observed=data.draw(st.booleans()))
        world.create(key)
        for _ in range(data.draw(st.integers(0, 3))):
            world.deliver(data.draw(st.integers(0, 1000)), duplicate=data.draw(st.booleans()))
    _check_quiescent(world)
