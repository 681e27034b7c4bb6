"""The bus plumbing, one module one job, written against the measured behaviour of nats-py 2.16 /
nats-server 2.15 (see docs/architecture.md):

- ``connect``: connecting with service-grade reconnects, and the ``Bus`` holder;
- ``provision``: the vmfence streams and KV buckets, created and checked idempotently;
- ``append``: fenced appends (one synchronous request each; a ``10071`` is disambiguated by the
  subject's last ``Nats-Msg-Id`` before it counts as a lost race) and retried publishes;
- ``read``: a subject's last message, one subject in order, a whole stream with gap detection;
- ``leases``: partition leases (revision CAS);
- ``deadletter``: parking an unprocessable message with its reason;
- ``logstream``: the decision log as records: read, follow, export format;
- ``wire`` and ``retry``: header names, error codes and which errors are transient; bounded retries.

Nothing is re-exported here: import from the module that does the job.
"""
