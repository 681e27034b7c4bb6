"""The test bench: whole stacks for people and tests (demo, `up`), the fault campaigns, the
benchmarks, the embedded nats-server launcher and the pure model world.

It may import every service; no service and no operator command imports it. Its commands reach the
``vmfence`` entry point through the ``vmfence.commands`` entry-point group (see
:mod:`services.testbed.commands`), and its extra dependencies come with ``pip install vmfence[testbed]``.
"""
