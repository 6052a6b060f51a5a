"""bench/gpu/gpu_check.sh and bench/serving/replicas.sh: valid bash, `--help` works without starting anything, and
every flag replicas.sh passes to `reformer serve` and `reformer loadtest` is one those commands accept.
gpu_check.sh runs here in its CPU dry run (tiny sizes, the tiny artifact): every step, the JSON report,
and a non-zero exit when a step fails (its time budget spent). replicas.sh runs by hand."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest.cli import build_parser as loadtest_parser
from service.settings import build_parser as serve_parser
from tests.docker.conftest import REPO

SCRIPTS = ("bench/gpu/gpu_check.sh", "bench/serving/replicas.sh")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def function_body(text: str, name: str) -> str:
    match = re.search(rf"^{name}\(\) \{{.*?^\}}", text, flags=re.S | re.M)
    assert match, f"no function {name}"
    return match.group(0)


def options_of(parser: object) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings}  # type: ignore[attr-defined]


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_parses_and_prints_help(script: str) -> None:
    subprocess.run(["bash", "-n", str(REPO / script)], check=True, timeout=30)
    shown = subprocess.run(["bash", str(REPO / script), "--help"], capture_output=True, text=True, timeout=30)
    assert shown.returncode == 0 and script in shown.stdout


def test_replicas_passes_flags_the_commands_accept() -> None:
    text = (REPO / "bench/serving/replicas.sh").read_text()
    loadtest_flags = set(FLAG.findall(function_body(text, "run_loadtest")))
    assert {"--url", "--docs", "--out"} <= loadtest_flags <= options_of(loadtest_parser())
    serve_flags = set(FLAG.findall(function_body(text, "start_replica")))
    assert {"--host", "--port"} <= serve_flags <= options_of(serve_parser())
    nginx_retry = "proxy_next_upstream error timeout http_503 non_idempotent;"
    assert nginx_retry in text


def run_gpu_check(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path / "gpu_check.json"
    (tmp_path / "no-wheels").mkdir(exist_ok=True)
    env = {**os.environ, "GPU_CHECK_PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(["bash", str(REPO / "bench/gpu/gpu_check.sh"), "--dry-run", "--out", str(out),
                             "--wheels", str(tmp_path / "no-wheels"), *args],
                            capture_output=True, text=True, timeout=300, env=env)
    return result, out


def test_gpu_check_dry_run_runs_every_step_on_the_cpu(tmp_path: Path, tiny_artifact: Path) -> None:
    result, out = run_gpu_check(tmp_path, "--artifact", str(tiny_artifact))
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["ok"] and report["failures"] == [] and report["mode"] == "dry-run"
    (service,) = report["services"]
    assert service["dtype"] == "float32" and service["info"]["device"] == "cpu" and service["exit_code"] == 0
    routes = {(row["route"], row["tokens"]) for row in service["requests"]}
    assert {route for route, _ in routes} == {"/embed", "/generate", "/generate_stream"}
    assert all(row["status"] == 200 for row in service["requests"])
    assert [rate["concurrency"] for rate in service["decode"]] == [1, 2]
    assert all(rate["tokens_per_s"] > 0 for rate in service["decode"])
    assert service["gpu_series"] == {}  # a CPU run: the GPU series are absent, not zero
    rows = report["forward"]["rows"]
    assert [row["tokens"] for row in rows] == [128, 256]
    assert all(row["reformer_tokens_per_s"] > 0 and row["sdpa_full_tokens_per_s"] > 0 for row in rows)
    graphs = report["decode_graphs"]  # on the CPU the "graph" replays by calling the step: plumbing only
    assert graphs["max_abs_diff"] == 0.0 and graphs["same_greedy_tokens"] and graphs["graphs_replays"] > 0
    assert graphs["graphs_captures"] >= 1 and graphs["eager_replays"] == 0
    half = report["half_cache_decode"]  # on the CPU: the C kernel's half pools against the float32 cache
    for dtype in ("float16", "bfloat16"):
        assert half[dtype]["agreement"] >= 0.9 and 0 < half[dtype]["max_abs_diff_while_agreeing"] <= 1.0


def test_gpu_check_fails_when_its_time_runs_out(tmp_path: Path, tiny_artifact: Path) -> None:
    env_budget = "0.5"
    result, out = run_gpu_check(tmp_path, "--artifact", str(tiny_artifact), "--budget-s", env_budget)
    assert result.returncode != 0
    report = json.loads(out.read_text())
    assert not report["ok"] and any("time budget" in failure for failure in report["failures"])
