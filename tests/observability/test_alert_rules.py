"""The alert rules load in Prometheus's own checker, and `promtool test rules` proves each
alert fires when it should and stays silent when it should not."""

from __future__ import annotations

import subprocess

import yaml

from tests.observability.conftest import require_binary
from tests.observability.dashboard import RULE_TESTS, RULES, rule_expressions


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [require_binary("promtool"), *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=RULES.parent,
    )


def test_promtool_check_rules_accepts_the_rule_file():
    result = promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_unit_tests_pass_and_cover_every_alert():
    tested = {
        case["alertname"]
        for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]
        for case in test["alert_rule_test"]
        if case["exp_alerts"]
    }
    assert tested == set(rule_expressions())
    result = promtool("test", "rules", str(RULE_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_rule_file_is_a_plain_rule_file_with_groups_at_the_top():
    """The chart wraps exactly this file's `groups` into a PrometheusRule."""
    assert list(yaml.safe_load(RULES.read_text())) == ["groups"]
