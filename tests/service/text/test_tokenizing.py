"""service/text/tokenizing.py: `json_array`'s pieces joined are what Starlette's JSONResponse renders;
`release_in_slices` empties its list."""

from __future__ import annotations

from typing import Any

import pytest
from starlette.responses import JSONResponse

from service.text.tokenizing import JSON_SLICE, json_array, release_in_slices


@pytest.mark.parametrize("values", [
    [], [1], list(range(JSON_SLICE)), list(range(2 * JSON_SLICE + 3)),
    ['"quoted"', "back\\slash", "é", "\n", "<0x00>", "\u2028"] * (JSON_SLICE // 3),
])
def test_json_array_pieces_are_what_jsonresponse_renders(values: list[Any]) -> None:
    pieces = json_array(values)
    assert b"".join(pieces) == JSONResponse(values).body
    assert len(pieces) == 2 + -(-len(values) // JSON_SLICE)  # one json.dumps per slice


def test_release_in_slices_empties_the_list() -> None:
    values = [str(i) for i in range(3 * JSON_SLICE * 8 + 5)]
    release_in_slices(values)
    assert values == []
