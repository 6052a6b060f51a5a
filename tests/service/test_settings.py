"""Settings: one documented class, environment and flags, and the CLI entry points."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from service.api.protocol import CompletionRequest, EmbeddingsRequest, EmbedRequest, GenerateRequest
from service.api.protocol.native import GenerateParameters
from service.engine.backends import kv_cache_dtype
from service.settings import Settings, settings_from_argv
from tests.service.conftest import REPO
from tests.service.helpers import running_app


def test_every_setting_and_request_field_is_documented() -> None:
    for name, field in Settings.model_fields.items():
        assert field.description, name
    for model in (GenerateRequest, GenerateParameters, EmbedRequest, CompletionRequest, EmbeddingsRequest):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name}"


def test_environment_then_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REFORMER_MAX_QUEUE_SIZE", "7")
    monkeypatch.setenv("REFORMER_CORS_ORIGINS", "https://a.example, https://b.example")
    monkeypatch.setenv("REFORMER_API_KEY", "zq-secret-zq")
    s = settings_from_argv(["--max-batch-size", "3", "--no-warmup"])
    assert s.max_queue_size == 7 and s.max_batch_size == 3 and s.warmup is False
    assert s.cors_origins == ["https://a.example", "https://b.example"]
    assert s.api_key is not None and "zq-secret-zq" not in repr(s) and "api_key" not in s.public_dict()
    s = settings_from_argv(["--max-queue-size", "9", "some/artifact"])
    assert s.max_queue_size == 9 and str(s.artifact) == "some/artifact"


def test_invalid_settings_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValidationError):
        Settings(max_queue_size=0)
    monkeypatch.setenv("REFORMER_BACKEND", "tensorflow")
    with pytest.raises(ValidationError):
        Settings()
    with pytest.raises(SystemExit):
        settings_from_argv(["--device", "tpu"])
    with pytest.raises(ValidationError):
        Settings(kv_cache_dtype="int8")
    with pytest.raises(ValidationError):
        Settings(prefill_budget_ms=-1)


def test_decode_weights_is_float32_unless_set_and_names_its_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings().decode_weights == "float32"
    monkeypatch.setenv("REFORMER_DECODE_WEIGHTS", "int8")
    assert Settings().decode_weights == "int8" and settings_from_argv(["--decode-weights", "bfloat16"]).decode_weights \
        == "bfloat16"
    monkeypatch.setenv("REFORMER_DECODE_WEIGHTS", "int4")
    with pytest.raises(ValidationError, match="decode_weights\n  Input should be 'float32', 'bfloat16' or 'int8'"):
        Settings()


def test_kv_cache_dtype_auto_is_the_models_and_half_needs_a_float32_model() -> None:
    assert kv_cache_dtype("auto", torch.float32) is None and kv_cache_dtype("auto", torch.bfloat16) is None
    assert kv_cache_dtype("bfloat16", torch.bfloat16) is None  # the model's own dtype
    assert kv_cache_dtype("float16", torch.float32) == torch.float16
    with pytest.raises(RuntimeError, match="kv_cache_dtype=float16 needs a float32 model; this one is bfloat16"):
        kv_cache_dtype("float16", torch.bfloat16)


def test_reformer_serve_help_lists_the_flags() -> None:
    out = subprocess.run([sys.executable, "-m", "service.cli", "serve", "--help"], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0
    for flag in ("--max-queue-size", "--max-batch-tokens", "--api-key", "--grace-period-s", "REFORMER_DEVICE"):
        assert flag in out.stdout


def test_an_empty_api_key_means_no_key(monkeypatch: pytest.MonkeyPatch, artifact: Any) -> None:
    monkeypatch.setenv("REFORMER_API_KEY", "")  # e.g. a templated env file that left the value out
    assert Settings().api_key is None
    assert Settings().public_dict()["api_key_set"] is False
    assert settings_from_argv(["--api-key", "  "]).api_key is None
    with running_app(artifact, backend="torch") as client:  # the app reads the same environment
        r = client.post("/generate", json={"inputs": "open", "parameters": {"max_new_tokens": 1}})
        assert r.status_code == 200, r.text


def test_cpu_kernels_takes_a_mode_and_the_older_booleans(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings().cpu_kernels == "auto"
    for given, want in (("on", "on"), ("off", "off"), ("auto", "auto"), ("1", "auto"), ("true", "auto"),
                        ("0", "off"), ("false", "off")):
        monkeypatch.setenv("REFORMER_CPU_KERNELS", given)
        assert Settings().cpu_kernels == want, given
    assert settings_from_argv(["--cpu-kernels", "on"]).cpu_kernels == "on"
    monkeypatch.setenv("REFORMER_CPU_KERNELS", "sometimes")
    with pytest.raises(ValidationError, match="cpu_kernels"):
        Settings()


def test_kernels_on_refuses_to_start_naming_the_reason(tmp_path: Any) -> None:
    """REFORMER_CPU_KERNELS=on where they cannot load (a forced variant that is not installed): exit 2 at once,
    the reason on stderr, before the artifact is even read."""
    env = {"PATH": "/usr/bin:/bin", "REFORMER_CPU_KERNELS": "on", "REFORMER_CPU_KERNEL_VARIANT": "avx512",
           "REFORMER_KERNEL_DIR": str(tmp_path), "HOME": str(tmp_path)}
    code = ("import sys; from model.kernels import build; "
            "build.installed = lambda folder=build.HERE: {}; "  # nothing installed, as a broken install
            "from service.api.server import main; sys.exit(main(['--device', 'cpu']))")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2, r.stderr
    assert "REFORMER_CPU_KERNELS=on but the C kernels cannot load (unavailable)" in r.stderr
    assert "REFORMER_CPU_KERNEL_VARIANT=avx512 is not installed" in r.stderr


def test_an_unwritable_prefix_cache_dir_refuses_to_start_naming_it(tmp_path: Any) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "REFORMER_PREFIX_CACHE_DIR": str(blocker / "cache")}
    r = subprocess.run([sys.executable, "-c", "import sys; from service.api.server import main; sys.exit(main([]))"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert f"REFORMER_PREFIX_CACHE_DIR {blocker / 'cache'}: cannot write there" in r.stderr
