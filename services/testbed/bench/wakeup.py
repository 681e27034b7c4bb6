"""What waking another process costs on this machine: the floor under every message the stack
sends when nothing batches (a pod at a low rate, or any pod when latency must stay low).

Two processes pass one byte back and forth over a socket pair, first with blocking calls (the
kernel's and the hypervisor's part alone), then with asyncio on uvloop (what each of the stack's
Python processes pays per wake-up before any of its own code). Both report the CPU (user + system)
each end spends per round trip; a round trip is two wake-ups. Run in a child process
(``measure``), so the benchmark's own event loop never forks.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import socket
import subprocess
import sys
import time
from typing import Any

ROUND_TRIPS = 20000


def _child_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _blocking(n: int) -> dict[str, float]:
    a, b = socket.socketpair()
    before = _child_cpu()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        a.close()
        for _ in range(n):
            b.recv(1)
            b.send(b"x")
        os._exit(0)
    b.close()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(n):
        a.send(b"x")
        a.recv(1)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    os.waitpid(pid, 0)
    a.close()
    return _figures(n, wall, cpu, _child_cpu() - before)


def _asyncio(n: int) -> dict[str, float]:
    import uvloop

    a, b = socket.socketpair()
    before = _child_cpu()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child

        async def serve() -> None:
            r, w = await asyncio.open_connection(sock=b)
            for _ in range(n):
                await r.readexactly(1)
                w.write(b"x")

        a.close()
        uvloop.run(serve())
        os._exit(0)
    b.close()

    async def client() -> tuple[float, float]:
        r, w = await asyncio.open_connection(sock=a)
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(n):
            w.write(b"x")
            await r.readexactly(1)
        out = time.perf_counter() - t0, time.process_time() - c0
        w.close()
        return out

    wall, cpu = uvloop.run(client())
    os.waitpid(pid, 0)
    return _figures(n, wall, cpu, _child_cpu() - before)


def _figures(n: int, wall: float, cpu: float, child_cpu: float) -> dict[str, float]:
    return {
        "round_trip_us": round(1e6 * wall / n, 1),
        "cpu_us_per_round_trip": round(1e6 * (cpu + child_cpu) / n, 1),
    }


def main() -> None:  # pragma: no cover - run by measure() in a child process
    n = int(sys.argv[1]) if len(sys.argv) > 1 else ROUND_TRIPS
    print(json.dumps({"round_trips": n, "blocking": _blocking(n), "asyncio_uvloop": _asyncio(n)}))


async def measure(n: int = ROUND_TRIPS) -> dict[str, Any]:
    """The figures above, from a child process (``python -m services.testbed.bench.wakeup``)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.testbed.bench.wakeup", str(n), stdout=subprocess.PIPE
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 120)
    if proc.returncode != 0:
        raise RuntimeError(f"wake-up baseline exited {proc.returncode}")
    got: dict[str, Any] = json.loads(out)
    return got


if __name__ == "__main__":
    main()
