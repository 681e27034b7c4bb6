"""The fence kernel: what every service agrees on, pure and synchronous.

- ``keys``: a fenced object's identity, its subject-token encoding, its partition;
- ``schema``: every message and record (msgspec, tagged, versioned);
- ``state``: a key's state and ``fold`` (state, decision) -> state;
- ``decide``: ``decide`` (state, input) -> decisions — the policy;
- ``audit``: the invariants checked over a whole log;
- ``podspec``: pods and VirtualMachine objects -> validated specs and observations.

It imports nothing but msgspec and the standard library (tests/unit/test_layout.py checks it), so the
reconciler, the audit, the model world and the property tests all run the very same rules.
"""
