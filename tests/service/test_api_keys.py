"""service/api_keys.py: the keys file's lines, and the refusals that name a bad line at start-up."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from service.api_keys import DEFAULT_TENANT, ApiKeysError, load_api_keys, parse_keys_file
from service.settings import Settings

KEY_A, KEY_B = "alpha-key-0123456789abcdef", "bravo-key-0123456789abcdef"


def test_lines_name_tenants_and_skip_comments() -> None:
    text = f"# tenants\n\nacme:{KEY_A}\n  globex.eu:{KEY_B}  \n"
    assert parse_keys_file(text, "f") == {KEY_A: "acme", KEY_B: "globex.eu"}


@pytest.mark.parametrize(("text", "says"), [
    (f"acme {KEY_A}", "line 1: expected `tenant:key`"),
    (f"ac me:{KEY_A}", "line 1: a tenant is"),
    ("acme:short", "line 1: a key is at least 16"),
    (f"acme:{KEY_A} x", "line 1: a key is at least 16"),
    (f"acme:{KEY_A}\nacme:{KEY_B}", "line 2: tenant 'acme' appears twice"),
    (f"acme:{KEY_A}\nglobex:{KEY_A}", "line 2: this key is already tenant 'acme'"),
    (f"{DEFAULT_TENANT}:{KEY_A}", "line 1: the tenant `default` is api_key's"),
])
def test_a_bad_line_is_refused_by_number(text: str, says: str) -> None:
    with pytest.raises(ApiKeysError, match=says.replace("(", r"\(")):
        parse_keys_file(text, "keys.txt")


def test_api_key_joins_the_file_as_the_default_tenant(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(f"acme:{KEY_A}\n")
    keys = load_api_keys(KEY_B, path)
    assert keys is not None and keys.by_key == {KEY_A: "acme", KEY_B: DEFAULT_TENANT}
    assert load_api_keys(None, None) is None
    with pytest.raises(ApiKeysError, match="also tenant 'acme'"):
        load_api_keys(KEY_A, path)


@pytest.mark.parametrize("content", ["", "# only a comment\n", "acme:short\n"])
def test_settings_refuse_an_unusable_file_at_start_up(tmp_path: Path, content: str) -> None:
    path = tmp_path / "keys"
    path.write_text(content)
    with pytest.raises(ValidationError, match="api_keys_file"):
        Settings(api_keys_file=path)
    with pytest.raises(ValidationError, match="cannot be read"):
        Settings(api_keys_file=tmp_path / "missing")


def test_the_keys_served_are_the_keys_validated(tmp_path: Path) -> None:
    """The file is read once, when the settings are validated: a file changed afterwards (say, a Secret mounted
    anew) changes nothing until a restart, so no key that start-up did not check is ever accepted."""
    path = tmp_path / "keys"
    path.write_text(f"acme:{KEY_A}\n")
    settings = Settings(api_keys_file=path)  # type: ignore[call-arg]
    path.write_text("acme: not a valid line\n")
    keys = settings.api_keys()
    assert keys is not None and keys.by_key == {KEY_A: "acme"}
