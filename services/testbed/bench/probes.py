"""CPU per readiness probe of the agent's ``Prober`` with N sim VMs on one host, beside its baseline
in the same run: the same number of the runtime's own probes awaited one after another.

``python -m services.testbed.bench.probes [VMS] [SECONDS]`` prints JSON. A host with thousands of
VMs probes each every ``--probe-interval``: that cost grows with the VMs and with the time they stay
up, so it showed as the fleet bench's cost per pod growing with the fleet (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time

from services.agent.ledger import Ledger, VMRow
from services.agent.probes import Prober
from services.agent.runtime import VMSpec, make_driver
from shared.fence.schema import Fence, ProbeChanged, Spec
from shared.tasks import cancel_and_wait, run_main

INTERVAL_S = 0.5


async def measure(vms: int, seconds: float) -> dict[str, object]:
    tmp = tempfile.mkdtemp(prefix="vmfence-bench-probes-")
    ledger = Ledger(os.path.join(tmp, "ledger.sqlite3"))
    await ledger.open()
    driver = make_driver("sim", state_dir=os.path.join(tmp, "runtime"), seed=1)
    await driver.open()
    try:
        ids = [f"vm-{i}" for i in range(vms)]
        for i, vm_id in enumerate(ids):
            await driver.create(VMSpec(vm_id=vm_id))
            await ledger.put_vm(VMRow(vm_id=vm_id, fence=Fence(f"default/p{i}", f"u{i}", 1), state="running",
                                      spec=Spec(cpus=1, memory_mib=64)))
        published = asyncio.Event()
        changes = 0

        async def publish(change: ProbeChanged) -> None:
            nonlocal changes
            changes += 1
            if changes == vms:
                published.set()

        prober = Prober(ledger, driver, "host-a", publish, interval=INTERVAL_S, timeout=5.0)
        run = asyncio.create_task(prober.run())
        await asyncio.wait_for(published.wait(), 60)  # every VM probed and reported once
        cpu0, t0 = time.process_time(), time.monotonic()
        await asyncio.sleep(seconds)  # the measured span: the prober's own schedule runs
        cpu, span = time.process_time() - cpu0, time.monotonic() - t0
        await cancel_and_wait([run])
        probes = vms * span / INTERVAL_S
        base_n = int(probes)
        cpu0 = time.process_time()
        for i in range(base_n):
            await driver.probe(ids[i % vms])
        base = time.process_time() - cpu0
    finally:
        await driver.close()
        await ledger.close()
    return {
        "bench": "probes",
        "vms": vms,
        "interval_s": INTERVAL_S,
        "seconds": round(span, 2),
        "prober_cpu_us_per_probe": round(1e6 * cpu / probes, 2),
        "baseline_runtime_probe_cpu_us": round(1e6 * base / max(1, base_n), 2),
    }


def main() -> None:  # pragma: no cover - manual
    vms = int(sys.argv[1]) if len(sys.argv) > 1 else 5000
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 5.0
    print(json.dumps(run_main(measure(vms, seconds))))


if __name__ == "__main__":
    main()
