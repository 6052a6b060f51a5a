"""docker/alerts.yml and docker/prometheus.yml through Debian's promtool: the rules and the config check,
and the rule unit tests (docker/alerts.test.yml) prove that each alert fires, and stays silent, as its name
says. A machine without promtool fails here, naming the package (scripts/test-deps.sh installs it; make test
and .ci/run call it)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from service.observability.metrics import BATCH_SIZE_BUCKETS
from tests.docker.conftest import DOCKER


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.fail("`promtool` is missing: install Debian's `prometheus` package "
                    "(scripts/test-deps.sh installs it; `make test` runs it first)")
    return found


def run(*args: str, cwd: Path = DOCKER) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool(), *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_rules_and_config_pass_promtool_check(tmp_path: Path) -> None:
    result = run("check", "rules", "alerts.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    # The config names the rules where compose mounts them; check it against the file in the repo.
    config = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    assert config["rule_files"] == ["/etc/prometheus/alerts.yml"]
    config["rule_files"] = [str(DOCKER / "alerts.yml")]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    result = run("check", "config", str(tmp_path / "prometheus.yml"))
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_firing_and_a_silent_unit_test() -> None:
    alerts = {rule["alert"] for group in yaml.safe_load((DOCKER / "alerts.yml").read_text())["groups"]
              for rule in group["rules"] if "alert" in rule}
    cases = [case for test in yaml.safe_load((DOCKER / "alerts.test.yml").read_text())["tests"]
             for case in test.get("alert_rule_test", [])]
    fires = {case["alertname"] for case in cases if case.get("exp_alerts")}
    silent = {case["alertname"] for case in cases if not case.get("exp_alerts")}
    assert alerts and fires == alerts and silent == alerts


def test_alert_rule_unit_tests_pass() -> None:
    result = run("test", "rules", "alerts.test.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_rule_unit_tests_can_fail(tmp_path: Path) -> None:
    # The slow-requests alert with light traffic under 30 s must not fire: expecting it to fails the run.
    tests = yaml.safe_load((DOCKER / "alerts.test.yml").read_text())
    silent_slow = next(test for test in tests["tests"] for case in test.get("alert_rule_test", [])
                       if case["alertname"] == "ReformerServeSlow" and not case["exp_alerts"])
    silent_slow["alert_rule_test"][-1]["exp_alerts"] = [{"exp_labels": {"severity": "warning"}}]
    tests["tests"] = [silent_slow]
    tests["rule_files"] = [str(DOCKER / "alerts.yml")]
    (tmp_path / "wrong.test.yml").write_text(yaml.safe_dump(tests))
    result = run("test", "rules", str(tmp_path / "wrong.test.yml"), cwd=tmp_path)
    assert result.returncode != 0 and "ReformerServeSlow" in result.stdout + result.stderr


def test_batch_size_buckets_are_the_ones_the_unit_test_feeds() -> None:
    # alerts.test.yml's dashboard case models the service's lowest buckets (0.999, 1]: keep them in step.
    assert BATCH_SIZE_BUCKETS[:2] == (0.999, 1.0)
