"""The Prometheus metrics an agent emits, defined in one place. Each agent has its own registry so
that several agents can live in one process (tests, demo); ``shared.httpserve`` serves it."""

from __future__ import annotations

from collections import Counter as _Counter

from prometheus_client import CollectorRegistry, Counter, Gauge

from shared import heap


class AgentMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(heap.GC_PAUSE)  # the process's, as on every service's /metrics
        self.commands = Counter("vmfence_commands", "Commands handled by op and result",
                                ["op", "result"], registry=self.registry)
        self.vms = Gauge("vmfence_vms", "VMs in the agent's ledger by state", ["state"],
                         registry=self.registry)
        self.reports = Counter("vmfence_agent_reports", "Reports published by kind", ["kind"],
                               registry=self.registry)
        self.redeliveries = Counter("vmfence_agent_redeliveries", "Commands answered from the ledger",
                                    registry=self.registry)
        self.command_retries = Counter("vmfence_agent_command_retries",
                                       "Commands redelivered after their execution failed (backoff)",
                                       registry=self.registry)
        self.ledger_writable = Gauge("vmfence_agent_ledger_writable",
                                     "1 while the ledger takes writes; 0: not ready, no new VMs",
                                     registry=self.registry)
        self.ledger_writable.set(1)
        self.snapshots = Gauge("vmfence_agent_snapshots", "Snapshots in the store a hibernated VM holds",
                               registry=self.registry)
        self.snapshot_bytes = Gauge("vmfence_agent_snapshot_bytes", "Bytes of the snapshots hibernated VMs hold",
                                    registry=self.registry)
        self.collected = Counter("vmfence_agent_collected", "What the collector deleted or released because no "
                                 "ledger record owned it, by kind", ["kind"], registry=self.registry)
        self.collected_bytes = Counter("vmfence_agent_collected_bytes", "Bytes of snapshot files collected",
                                       registry=self.registry)
        self.addresses = Gauge("vmfence_agent_addresses", "Pod network addresses by state (held by a VM's fence, "
                               "free)", ["state"], registry=self.registry)
        self._states: set[str] = set()

    def set_vms(self, states: list[str]) -> None:
        """The VM gauge from the ledger's states; a state no VM is in any more reads 0."""
        counts = _Counter(states)
        for s in self._states | counts.keys():
            self.vms.labels(state=s).set(counts.get(s, 0))
        self._states |= counts.keys()
