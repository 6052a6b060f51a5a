"""`--reversible auto` sizes plain autograd against MemAvailable (free memory plus droppable page cache)."""

from __future__ import annotations

from pathlib import Path

import pytest

from train.step import available_memory_bytes


@pytest.mark.skipif(not Path("/proc/meminfo").exists(), reason="Linux only")
def test_available_memory_is_memavailable() -> None:
    fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
              if line.startswith(("MemAvailable:", "MemTotal:"))}
    got = available_memory_bytes()
    # read a moment apart: allow 256 MiB of drift, far below the page cache free pages alone would miss
    assert abs(got - fields["MemAvailable"]) < 256 * 2**20
    assert 0 < got <= fields["MemTotal"]
