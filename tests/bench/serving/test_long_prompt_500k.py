"""bench/serving/long_prompt_500k.py: the decode cache's bytes per token by layer kind, and prompts cut to a
token count."""

from __future__ import annotations

from pathlib import Path

import pytest

import bench.serving.long_prompt_500k as long_prompt
from model import ByteTokenizer
from model.decoding import DecodeCache
from tests.conftest import tiny_model


@pytest.mark.parametrize("layers", [["local", "lsh"], ["local", "lsh", "local", "lsh", "local", "lsh"]])
def test_bytes_per_token_by_layer_kind_add_up_to_the_caches_own_count(layers: list[str]) -> None:
    lm = tiny_model(attn_layers=layers)
    counted = long_prompt.cache_bytes_per_token(lm)
    cache = DecodeCache(lm, 0, 1, cpu_kernel=False)
    assert counted["bytes_per_token"] == cache.bytes_per_token == counted["lsh_layer"] * counted["lsh_layers"]
    assert counted["local_layer_position"] == 2 * 2 * 16 * 4  # a float32 key and value of 2 heads x 16
    assert counted["local_window_positions"] == 16  # chunks of 8, one before
    assert counted["local_bytes_per_slot"] == 16 * counted["local_layer_position"] * counted["local_layers"]


def test_prompts_are_cut_to_their_token_counts_repeating_a_short_book(tmp_path: Path) -> None:
    book = tmp_path / "book.txt"
    book.write_text("caf\u00e9 au lait, " * 50, encoding="utf-8")  # 750 characters, 800 bytes
    texts = long_prompt.prompt_texts(ByteTokenizer(), book, [10, 799, 2000])
    assert {n: count for n, (_, count) in texts.items()} == {10: 10, 799: 799, 2000: 2000}
    assert texts[10][0] == "caf\u00e9 au l"  # the byte tokenizer's ids: one per byte, \u00e9 is two


def test_gaps_are_the_differences_in_milliseconds() -> None:
    assert long_prompt.gaps_ms([1.0, 1.002, 1.005]) == pytest.approx([2.0, 3.0])
    assert long_prompt.gaps_ms([1.0]) == []
