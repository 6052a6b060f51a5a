"""bench/gpu_check.sh and bench/replicas.sh: valid bash, `--help` works without starting anything, and
every flag they pass to `reformer serve` and `reformer loadtest` is one those commands accept. (The
scripts themselves start servers and run for minutes: they run by hand, never in the suite.)"""

from __future__ import annotations

import re
import subprocess

import pytest

from bench.loadtest import build_parser as loadtest_parser
from service.settings import build_parser as serve_parser
from tests.docker.conftest import REPO

SCRIPTS = ("bench/gpu_check.sh", "bench/replicas.sh")
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
    text = (REPO / "bench/replicas.sh").read_text()
    loadtest_flags = set(FLAG.findall(function_body(text, "run_loadtest")))
    assert {"--url", "--docs", "--out"} <= loadtest_flags <= options_of(loadtest_parser())
    serve_flags = set(FLAG.findall(function_body(text, "start_replica")))
    assert {"--host", "--port"} <= serve_flags <= options_of(serve_parser())
    nginx_retry = "proxy_next_upstream error timeout http_503 non_idempotent;"
    assert nginx_retry in text


def test_gpu_check_passes_flags_reformer_serve_accepts() -> None:
    text = (REPO / "bench/gpu_check.sh").read_text()
    (server_args,) = re.findall(r"^SERVER_ARGS=\((.*)\)$", text, flags=re.M)
    flags = set(FLAG.findall(server_args))
    assert {"--device", "--port", "--host"} <= flags <= options_of(serve_parser())
