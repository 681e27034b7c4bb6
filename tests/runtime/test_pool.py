from __future__ import annotations

import socket

import pytest

from services.agent.runtime import DisplayPool, ReservationError, RuntimeFailure, VMSpec, vnc_owner
from services.agent.runtime.pool import _port_free


def test_reserve_distinct_and_lowest_first() -> None:
    pool = DisplayPool(range(3), check_port=False)
    got = [pool.reserve(f"vm{i}/u/1") for i in range(3)]
    assert got == [0, 1, 2]
    with pytest.raises(RuntimeFailure):
        pool.reserve("vm3/u/1")


def test_release_only_by_owner() -> None:
    pool = DisplayPool(range(2), check_port=False)
    d = pool.reserve("a/uid1/1")
    with pytest.raises(ReservationError):
        pool.release(d, "a/uid2/2")  # the successor incarnation may not free the predecessor's
    assert pool.owner_of(d) == "a/uid1/1"
    pool.release(d, "a/uid1/1")
    assert pool.owner_of(d) is None
    pool.release(d, "a/uid1/1")  # releasing a free display is a no-op
    assert pool.reserve("b/u/1") == d


def test_claim_restores_and_refuses_conflicts() -> None:
    pool = DisplayPool(range(5), check_port=False)
    pool.claim(3, "x/u/1")
    pool.claim(3, "x/u/1")  # idempotent
    with pytest.raises(ReservationError):
        pool.claim(3, "y/u/1")
    with pytest.raises(ReservationError):
        pool.claim(9, "y/u/1")  # outside the range
    assert pool.owners() == {3: "x/u/1"}
    assert [pool.reserve(f"o{i}") for i in range(4)] == [0, 1, 2, 4]


def test_reserve_skips_displays_whose_port_is_taken() -> None:
    # a listener on an ephemeral port whose next port is free (other tests' servers run meanwhile
    # on ephemeral ports too: the suite once met a taken next port)
    for _ in range(50):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.listen()
        if _port_free(port + 1):
            break
        s.close()
    else:
        pytest.fail("no ephemeral port with a free next port in 50 tries")
    try:
        display = port - DisplayPool.BASE_PORT
        if display < 0:
            pytest.skip("ephemeral port below 5900")
        pool = DisplayPool(range(display, display + 2))
        assert pool.reserve("a") == display + 1
    finally:
        s.close()


def test_vnc_owner_from_labels() -> None:
    spec = VMSpec(vm_id="p1", labels={"vmfence.io/uid": "u-9", "vmfence.io/epoch": "4"})
    assert vnc_owner(spec) == "p1/u-9/4"


def test_a_port_a_closed_vnc_connection_left_in_time_wait_is_free_and_a_listening_one_is_not() -> None:
    """A removed VM's display must be reusable at once, as QEMU (which binds with SO_REUSEADDR) can
    use it: the server side that closes first keeps the port in TIME_WAIT for a minute. The full
    suite lost a QEMU test to it: a display freed by a remove looked taken to the pool."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    assert not _port_free(port, "127.0.0.1")  # listening: taken
    client = socket.create_connection(("127.0.0.1", port))
    served, _ = listener.accept()
    served.close()  # the server side closes first: it is the side left in TIME_WAIT
    assert client.recv(1) == b""
    client.close()
    listener.close()
    assert _port_free(port, "127.0.0.1")
