"""vmfence development Kubernetes API server — for development and tests, never production.

Entry points live in :mod:`services.apiserver.server` (``ApiServer``, ``start_apiserver``,
``write_kubeconfig``, ``main``); fault injection in :mod:`services.apiserver.faults`.
This package imports nothing else from vmfence: it stands in for a foreign system.
"""
