"""An artifact's optional chat template: written by `reformer export --chat-template FILE` (or save_artifact),
listed and hashed in the manifest, read back by load_artifact; one that does not parse is refused at both ends."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from export import ArtifactError, load_artifact, save_artifact
from export.artifact import CHAT_TEMPLATE_FILE, file_sha256
from export.cli import export_main
from tests.conftest import tiny_model
from tests.export.helpers import write_checkpoint

TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}" \
           "{% if add_generation_prompt %}<assistant>{% endif %}"


def test_the_template_travels_with_the_artifact(tmp_path: Path) -> None:
    out = save_artifact(tiny_model(), tmp_path / "art", onnx=False, chat_template=TEMPLATE)
    assert (out / CHAT_TEMPLATE_FILE).read_text() == TEMPLATE
    art = load_artifact(out)
    assert art.chat_template == TEMPLATE
    assert art.manifest["files"][CHAT_TEMPLATE_FILE]["sha256"] == file_sha256(out / CHAT_TEMPLATE_FILE)


def test_an_artifact_without_a_template_has_none(tiny_artifact: Path) -> None:
    assert load_artifact(tiny_artifact).chat_template is None


def test_a_template_that_does_not_parse_is_refused_at_export(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="chat_template: not a valid Jinja template"):
        save_artifact(tiny_model(), tmp_path / "art", onnx=False, chat_template="{% for m in messages %}")
    assert not (tmp_path / "art").exists()


def test_an_altered_or_broken_template_is_refused_at_load(tmp_path: Path) -> None:
    out = save_artifact(tiny_model(), tmp_path / "art", onnx=False, chat_template=TEMPLATE)
    (out / CHAT_TEMPLATE_FILE).write_text(TEMPLATE + " ")
    with pytest.raises(ArtifactError, match=f"{CHAT_TEMPLATE_FILE}: size differs"):
        load_artifact(out)
    broken = "{% if %}"
    (out / CHAT_TEMPLATE_FILE).write_text(broken)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["files"][CHAT_TEMPLATE_FILE] = {"sha256": file_sha256(out / CHAT_TEMPLATE_FILE), "size": len(broken)}
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=f"{CHAT_TEMPLATE_FILE}: not a valid Jinja template"):
        load_artifact(out)


def test_export_command_stores_the_template_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt")
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    assert export_main([str(ckpt), str(tmp_path / "art"), "--no-onnx", "--chat-template", str(template)]) == 0
    assert load_artifact(tmp_path / "art").chat_template == TEMPLATE
    template.write_text("{{ unclosed")
    assert export_main([str(ckpt), str(tmp_path / "bad"), "--no-onnx", "--chat-template", str(template)]) == 1
    assert "not a valid Jinja template" in capsys.readouterr().err
