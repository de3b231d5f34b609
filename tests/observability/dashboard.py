"""What the dashboard and the alert rules ask Prometheus, read from their files."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import yaml

from testing.launcher import REPO_ROOT

OBSERVABILITY = REPO_ROOT / "observability"
DASHBOARD = OBSERVABILITY / "dashboards" / "radixserve.json"
RULES = OBSERVABILITY / "alerts" / "radixserve.rules.yaml"
RULE_TESTS = OBSERVABILITY / "alerts" / "radixserve.rules.test.yaml"
RATE_WINDOW = "5m"
"""Stands in for Grafana's $__rate_interval: longer than the whole test run."""
METRIC_NAME = re.compile(r"\bradixserve_[a-z0-9_]+")
SWA_METRIC = re.compile(r"\bradixserve_[a-z0-9_]*swa[a-z0-9_]*")
"""A sliding-window series: only a hybrid model (Gemma 3) exports it."""


def hybrid_only(expr: str) -> bool:
    """Whether `expr` (a query or a metric name) asks for a sliding-window series."""
    return SWA_METRIC.search(expr) is not None


def panel_queries() -> Iterator[tuple[str, str, str]]:
    """(panel title, refId, expression) of every panel target."""
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel.get("targets", []):
            yield panel["title"], target["refId"], target["expr"]


def panel_query(title: str, ref_id: str = "A") -> str:
    return next(expr for t, r, expr in panel_queries() if (t, r) == (title, ref_id))


def variable_queries() -> dict[str, str]:
    """Template variable name → its label_values(...) query."""
    variables = json.loads(DASHBOARD.read_text())["templating"]["list"]
    return {v["name"]: v["query"]["query"] for v in variables if v["type"] == "query"}


def label_values_as_promql(query: str) -> tuple[str, str]:
    """Grafana's `label_values(selector, label)` as (PromQL listing the label's values, label)."""
    selector, label = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", query).groups()
    return f"group by ({label}) ({selector})", label


def rule_expressions() -> dict[str, str]:
    return {
        rule["alert"]: rule["expr"]
        for group in yaml.safe_load(RULES.read_text())["groups"]
        for rule in group["rules"]
    }


def substitute(expr: str, model: str) -> str:
    """The expression as Grafana sends it with `model` chosen and all instances."""
    return (
        expr.replace("$__rate_interval", RATE_WINDOW)
        .replace("$model_name", model)
        .replace("$instance", ".*")
    )


def metric_names_used() -> set[str]:
    exprs = (
        [e for _, _, e in panel_queries()]
        + list(variable_queries().values())
        + list(rule_expressions().values())
    )
    return {name for expr in exprs for name in METRIC_NAME.findall(expr)}
