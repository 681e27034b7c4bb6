"""Alert rules and the Grafana dashboard: they parse, query only metrics the services expose, and
every alert leads to a runbook section that exists in docs/operations.md."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import yaml

from .conftest import DEPLOY, DOCS

# The metrics the services expose (name -> type); histograms also expose _bucket, _sum, _count.
METRICS: dict[str, str] = {
    "vmfence_decisions_total": "counter",
    "vmfence_inputs_total": "counter",
    "vmfence_pod_lifecycle_total": "counter",
    "vmfence_append_seconds": "histogram",
    "vmfence_append_lost_races_total": "counter",
    "vmfence_partitions_owned": "gauge",
    "vmfence_lease_lost_total": "counter",
    "vmfence_dead_letters_total": "counter",
    "vmfence_commands_total": "counter",
    "vmfence_vms": "gauge",
    "vmfence_host_heartbeat_age_seconds": "gauge",
    "vmfence_k8s_writes_total": "counter",
    "vmfence_consumer_pending": "gauge",
    "vmfence_effect_seconds": "histogram",
    "vmfence_audit_violations_total": "counter",
    "vmfence_drift": "gauge",
    "vmfence_drift_checks_total": "counter",
    "vmfence_quarantined_keys": "gauge",
    "vmfence_log_undecodable_total": "counter",
}
# labels each metric carries (beyond job/instance)
LABELS: dict[str, set[str]] = {
    "vmfence_decisions_total": {"type"},
    "vmfence_inputs_total": {"kind", "result"},
    "vmfence_pod_lifecycle_total": {"op", "result", "reason"},
    "vmfence_dead_letters_total": {"reason"},
    "vmfence_commands_total": {"op", "result"},
    "vmfence_vms": {"state"},
    "vmfence_host_heartbeat_age_seconds": {"host"},
    "vmfence_k8s_writes_total": {"verb", "result"},
    "vmfence_consumer_pending": {"partition"},
    "vmfence_effect_seconds": {"kind"},
    "vmfence_partitions_owned": {"reconciler"},
    "vmfence_lease_lost_total": {"reconciler"},
    "vmfence_drift": {"kind"},
    "vmfence_drift_checks_total": {"result"},
    "vmfence_quarantined_keys": {"partition"},
}
REQUIRED_ALERTS = {
    "VmfenceAuditViolation": "critical",
    "VmfenceDeadLetters": None,
    "VmfenceHostHeartbeatStale": None,
    "VmfenceConsumerLagHigh": None,
    "VmfencePartitionUnowned": None,
    "VmfenceAppendLatencyHigh": None,
    "VmfenceLeaseFlapping": None,
    "VmfenceK8sWriteErrors": None,
}
_METRIC_RE = re.compile(r"\b(vmfence_[a-z0-9_]+)")
_SELECTOR_RE = re.compile(r"\b(vmfence_[a-z0-9_]+)\s*\{([^}]*)\}")


def known_metric(name: str) -> bool:
    if name in METRICS:
        return True
    for suffix in ("_bucket", "_sum", "_count"):
        base = name.removesuffix(suffix)
        if base != name and METRICS.get(base) == "histogram":
            return True
    return False


def base_metric(name: str) -> str:
    for suffix in ("_bucket", "_sum", "_count"):
        if name.endswith(suffix) and METRICS.get(name.removesuffix(suffix)) == "histogram":
            return name.removesuffix(suffix)
    return name


def check_expr(expr: str, where: str) -> set[str]:
    """Metric names an expression queries; fails on unknown metrics or labels."""
    names = set(_METRIC_RE.findall(expr))
    assert names, f"{where}: queries no vmfence metric"
    for n in names:
        assert known_metric(n), f"{where}: unknown metric {n}"
    for name, matchers in _SELECTOR_RE.findall(expr):
        for label in re.findall(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)", matchers):
            if label in ("job", "instance", "namespace", "pod"):
                continue
            assert label in LABELS.get(base_metric(name), set()), f"{where}: {name} has no label {label}"
    for by in re.findall(r"\bby\s*\(([^)]*)\)", expr):
        for label in (x.strip() for x in by.split(",") if x.strip()):
            if label in ("le", "job", "instance", "namespace", "pod"):
                continue
            assert any(label in LABELS.get(base_metric(n), set()) for n in names), f"{where}: by ({label})"
    try:
        import promql_parser  # optional, stricter: a real PromQL parser
    except ImportError:
        pass
    else:
        promql_parser.parse(expr.replace("$__rate_interval", "5m").replace("$job", ".*"))
    return names


def anchors(markdown: str) -> set[str]:
    """GitHub-style heading anchors plus explicit <a id=...> / {#...} anchors."""
    out = set(re.findall(r'<a\s+(?:id|name)="([^"]+)"', markdown))
    out |= set(re.findall(r"\{#([\w-]+)\}", markdown))
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*$", markdown, re.M):
        heading = re.sub(r"\{#[\w-]+\}", "", heading)
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        out.add(slug)
    return out


@pytest.fixture(scope="module")
def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yaml").read_text())
    assert isinstance(doc["groups"], list) and doc["groups"]
    out = []
    for group in doc["groups"]:
        assert group["name"] and group["rules"]
        out.extend(group["rules"])
    return out


def test_required_alerts_exist_with_severity(rules: list[dict[str, Any]]) -> None:
    by_name = {r["alert"]: r for r in rules}
    assert len(by_name) == len(rules), "alert names are unique"
    for name, severity in REQUIRED_ALERTS.items():
        assert name in by_name, f"missing alert {name}"
        if severity:
            assert by_name[name]["labels"]["severity"] == severity
    for r in rules:
        assert r["labels"]["severity"] in {"critical", "warning", "info"}, r["alert"]
        assert r["annotations"]["summary"], r["alert"]
        if "for" in r:
            assert re.fullmatch(r"\d+[smh]", r["for"]), r["alert"]


def test_alert_expressions_query_known_metrics(rules: list[dict[str, Any]]) -> None:
    for r in rules:
        check_expr(r["expr"], r["alert"])


def test_every_alert_has_a_runbook_in_operations_md(rules: list[dict[str, Any]]) -> None:
    ops = (DOCS / "operations.md").read_text()
    known = anchors(ops)
    for r in rules:
        url = r["annotations"]["runbook_url"]
        path, sep, anchor = url.partition("#")
        assert sep and anchor, f"{r['alert']}: runbook_url needs an anchor"
        assert path.endswith("docs/operations.md"), f"{r['alert']}: {url}"
        assert anchor in known, f"{r['alert']}: no #{anchor} in docs/operations.md"
        assert anchor == r["alert"].lower(), "anchor named after the alert"


def test_dashboard(rules: list[dict[str, Any]]) -> None:
    dash = json.loads((DEPLOY / "grafana" / "vmfence-dashboard.json").read_text())
    assert dash["title"] and dash["uid"]
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    queried: set[str] = set()
    for p in panels:
        assert p["targets"], p["title"]
        for t in p["targets"]:
            queried |= {base_metric(n) for n in check_expr(t["expr"], f"panel {p['title']!r}")}
    for var in dash.get("templating", {}).get("list", []):
        q = var.get("query")
        if isinstance(q, dict):
            q = q.get("query", "")
        if isinstance(q, str) and "vmfence_" in q:
            for n in _METRIC_RE.findall(q):
                assert known_metric(n), f"variable {var['name']}: {n}"
    # the panels operators asked for
    for metric in (
        "vmfence_decisions_total",
        "vmfence_append_seconds",
        "vmfence_append_lost_races_total",
        "vmfence_dead_letters_total",
        "vmfence_vms",
        "vmfence_host_heartbeat_age_seconds",
        "vmfence_consumer_pending",
        "vmfence_k8s_writes_total",
        "vmfence_pod_lifecycle_total",
    ):
        assert metric in queried, f"dashboard lacks {metric}"
    # no overlapping panels on the grid
    cells: set[tuple[int, int]] = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"panel {p['title']!r} overlaps another"
                cells.add((x, y))
        assert g["x"] + g["w"] <= 24


def test_check_expr_rejects_unknown_metrics() -> None:
    with pytest.raises(AssertionError):
        check_expr("rate(vmfence_made_up_total[5m])", "self-test")
    with pytest.raises(AssertionError):
        check_expr('sum(vmfence_vms{colour="red"})', "self-test")


def test_operations_md_documents_every_metric() -> None:
    ops = (DOCS / "operations.md").read_text()
    for name in METRICS:
        assert f"`{name}`" in ops, f"docs/operations.md: metric table lacks {name}"


def test_metric_table_matches_the_projects_definitions() -> None:
    """Metrics the project defines in services.reconciler.metrics have the names, types and labels assumed here."""
    metrics = pytest.importorskip("services.reconciler.metrics")
    from prometheus_client.metrics import MetricWrapperBase

    seen = 0
    for obj in vars(metrics).values():
        if not isinstance(obj, MetricWrapperBase):
            continue
        (desc,) = obj.describe()
        name = f"{desc.name}_total" if desc.type == "counter" else desc.name
        if name not in METRICS:
            continue
        seen += 1
        assert desc.type == METRICS[name], f"{name}: {desc.type}, the dashboards assume {METRICS[name]}"
        assert set(obj._labelnames) == LABELS.get(name, set()), f"{name}: labels {obj._labelnames}"
    assert seen, "services.reconciler.metrics defines none of the metrics"


def _metrics_defined_in_code() -> dict[str, str]:
    """Every metric the code constructs (name as exposed -> type), read from the source: calls of
    prometheus_client's Counter/Gauge/Histogram/Summary and of the *MetricFamily collectors with a
    literal name. A Counter named ``x`` is exposed as ``x_total``."""
    import ast

    root = DEPLOY.parent
    kinds = {"Counter": "counter", "Gauge": "gauge", "Histogram": "histogram", "Summary": "summary",
             "CounterMetricFamily": "counter", "GaugeMetricFamily": "gauge", "HistogramMetricFamily": "histogram"}
    out: dict[str, str] = {}
    for path in [*root.joinpath("services").rglob("*.py"), *root.joinpath("shared").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            first = node.args[0]
            if func in kinds and isinstance(first, ast.Constant) and isinstance(first.value, str):
                name, kind = first.value, kinds[func]
                if kind == "counter" and not name.endswith("_total"):
                    name += "_total"
                out[name] = kind
    return out


def _metrics_used_by_deploy() -> dict[str, set[str]]:
    """Every vmfence_* name the dashboards and alert rules query -> the files that query it."""
    used: dict[str, set[str]] = {}
    files = [*DEPLOY.joinpath("grafana").rglob("*.json"), *DEPLOY.joinpath("prometheus").rglob("*.yaml"),
             *DEPLOY.joinpath("helm", "vmfence", "files").rglob("*.yaml")]
    assert files
    for path in files:
        for name in _METRIC_RE.findall(path.read_text()):
            used.setdefault(name, set()).add(path.name)
    return used


def test_every_metric_a_dashboard_or_alert_uses_is_defined_in_code() -> None:
    defined = _metrics_defined_in_code()
    missing = []
    for name, where in sorted(_metrics_used_by_deploy().items()):
        base = name
        for suffix in ("_bucket", "_sum", "_count"):
            if name.endswith(suffix) and defined.get(name.removesuffix(suffix)) in ("histogram", "summary"):
                base = name.removesuffix(suffix)
        if base not in defined:
            missing.append(f"{name} (in {', '.join(sorted(where))})")
    assert missing == [], "metrics used by deploy/ that no code defines: " + "; ".join(missing)


def test_the_metric_table_here_agrees_with_the_code() -> None:
    """METRICS above (what the dashboard checks assume) names only metrics the code defines, with their types."""
    defined = _metrics_defined_in_code()
    for name, kind in METRICS.items():
        assert defined.get(name) == kind, f"{name}: the code defines {defined.get(name)}, the table says {kind}"


def test_the_heartbeat_age_gauge_reports_each_host_a_reconciler_sees() -> None:
    from prometheus_client import REGISTRY

    from services.reconciler.hosts import HostsView
    from shared.fence.heartbeat import HostHeartbeat

    view = HostsView()
    view.update(HostHeartbeat(host="gauge-host", runtime="sim", cpus_total=2, cpus_free=2,
                              memory_total_mib=1024, memory_free_mib=1024, vms=0, at=0.0))
    age = REGISTRY.get_sample_value("vmfence_host_heartbeat_age_seconds", {"host": "gauge-host"})
    assert age is not None and 0 <= age < 60
    view.remove("gauge-host")
    assert REGISTRY.get_sample_value("vmfence_host_heartbeat_age_seconds", {"host": "gauge-host"}) is None
