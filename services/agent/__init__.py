"""vmfence agent: the per-host executor, the only place a VM is ever touched.

``service`` (consumer, reports, inventory, heartbeat, HTTP; ``Agent`` and ``main``), ``executor``
(look / act on the difference / record, fence checks), ``ledger`` (SQLite WAL: VMs and owner fences,
results by command id, tombstones, reservations), ``probes``, ``config``; ``runtime/`` holds the
drivers.
"""
