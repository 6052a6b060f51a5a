"""Local layers keep only their window in the decode cache (model/decoding/local_ring.py): a ring of
chunk x (chunks before + 1) positions per slot. With windows of 8 positions (chunks of 4, one before), prompts
of 25 and 5 tokens in one batch and 40 steps wrap the ring many times; on every decode path (the fused C step,
the per-layer C path, PyTorch), after a prefill in one piece or in slices shorter and longer than the window,
with and without successor-value heads, the logits are the bits of a cache whose rings never wrap (every
position its own row: the full cache), and equal the forward over the prefix where the cached keys are the
forward's. The bytes per token count the LSH layers alone."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import model.decoding.cache as cache_module
from bench.import_hf.import_hf_crime import CRIME_AND_PUNISHMENT
from model import ReformerConfig, ReformerLM
from model.decoding import DecodeCache, Decoder, prefill, prefill_steps
from model.decoding.cache_state import CacheFull
from model.decoding.lsh_index import LSHIndex

from ..helpers import tiny_config

# one intra-op thread, as a decode step of a few rows runs (tests/model/conftest.py)
pytestmark = pytest.mark.usefixtures("one_thread")

WINDOW = 8  # local chunks of 4, one chunk before
LENGTHS = (3 * WINDOW + 1, 5)  # one prompt past three windows, one within the first
STEPS = 40
PATHS = ["fused", "c-per-layer", "torch"]


def _model(layers: list[str], successor: int = 0, initializer_range: float = 0.5) -> ReformerLM:
    """tests/model/helpers.py's tiny model (its large default init makes attention sharp, so a wrong key shows
    in the logits) with local windows of WINDOW positions."""
    torch.manual_seed(0)
    return ReformerLM(tiny_config(attn_layers=layers, local_attn_chunk_length=4, local_num_chunks_before=1,
                                  lsh_attn_chunk_length=4, vocab_size=258, lsh_successor_heads=successor,
                                  initializer_range=initializer_range)).eval()


def _prompts() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 258, (n,), generator=g) for n in LENGTHS]


def _decoder(lm: ReformerLM, path: str, ring: int | None = None) -> Decoder:
    """A decoder for the two prompts and their steps on `path`; `ring`: the rings' width instead of the window
    (one wider than every request is the full cache: no position's row is ever reused)."""
    with pytest.MonkeyPatch.context() as patch:
        if ring is not None:
            patch.setattr(cache_module, "local_window_width", lambda _: ring)
        cache = DecodeCache.for_tokens(lm, max(LENGTHS) + STEPS + 1, slots=2, cpu_kernel=path != "torch")
    decoder = Decoder(lm, cache)
    if path == "c-per-layer":
        decoder.backends.fused = None
    if path != "torch":
        assert decoder.backends.window is not None, "the C kernels did not load"
    return decoder


def _run(lm: ReformerLM, decoder: Decoder, prompts: list[torch.Tensor], slice_chunks: int | None,
         steps: int = STEPS) -> Iterator[torch.Tensor]:
    """The logits after each prompt (N, vocab), then after each greedy step; the batch's cache freed at the end."""
    cache = decoder.cache
    reserve = [len(p) + steps + 1 for p in prompts]
    if slice_chunks is None:
        logits, states = prefill(lm, cache, prompts, reserve)
    else:
        run = prefill_steps(lm, cache, prompts, reserve, slice_chunks=slice_chunks)
        while True:
            try:
                next(run)
            except StopIteration as done:
                logits, states = done.value
                break
    yield logits
    for _ in range(steps):
        # no yield inside no_grad: a generator suspended there leaves gradients off for its caller
        with torch.no_grad():
            logits = decoder.step(logits.argmax(-1).tolist(), states)
        yield logits
    for state in states:
        cache.free(state)


# slice_chunks counts (row, head, chunk) window attentions: 2 rows x 2 heads, so 4 is one chunk of 4 positions
# (shorter than the window) per slice and 64 sixteen chunks (longer); None is the prefill in one piece
@pytest.mark.parametrize("slice_chunks", [None, 4, 64], ids=["whole", "slices-of-4", "slices-of-64"])
@pytest.mark.parametrize("successor", [0, 1], ids=["plain", "successor-heads"])
@pytest.mark.parametrize("path", PATHS)
def test_the_ring_gives_the_bits_of_the_full_cache(path: str, successor: int, slice_chunks: int | None) -> None:
    lm = _model(["local", "lsh", "local", "lsh"], successor)
    ring, full = _decoder(lm, path), _decoder(lm, path, ring=128)
    assert ring.cache.keys[0].shape[0] == 3 * WINDOW and full.cache.keys[0].shape[0] == 3 * 128
    prompts = _prompts()
    for got, want in zip(_run(lm, ring, prompts, slice_chunks), _run(lm, full, prompts, slice_chunks), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("successor", [0, 1], ids=["plain", "successor-heads"])
@pytest.mark.parametrize("path", PATHS)
def test_the_ring_decodes_as_the_forward_over_the_prefix(path: str, successor: int) -> None:
    """Local layers under the LSH layer only, so every cached key is the forward's; within 1e-5 at
    tests/model/decoding/test_decode.py's init of 0.3 (logits up to about 6): the forward attends a chunk's
    queries together, the step one row alone, and the float sums differ in order (at the init of 0.5, logits
    up to 13 differ by up to 2.2e-5, in the full cache's bits too: the test above)."""
    lm = _model(["local", "local", "lsh"], successor, initializer_range=0.3)
    prompts = _prompts()
    seqs = [p.tolist() for p in prompts]
    for i, logits in enumerate(_run(lm, _decoder(lm, path), prompts, None)):
        with torch.no_grad():
            for row, seq in enumerate(seqs):
                full = lm(torch.tensor([seq])).logits[0, -1]
                assert (full - logits[row]).abs().max().item() <= 1e-5, (i, row)
        if i < STEPS:
            for seq, token in zip(seqs, logits.argmax(-1).tolist(), strict=True):
                seq.append(token)


@pytest.mark.parametrize("path", PATHS)
def test_a_reused_slot_reads_nothing_of_the_last_requests_ring(path: str) -> None:
    """A 3-token prompt in the slots two longer requests wrote: the same bits as in a fresh cache."""
    lm = _model(["local", "lsh", "local", "lsh"])
    used, fresh = _decoder(lm, path), _decoder(lm, path)
    for _ in _run(lm, used, _prompts(), None):
        pass
    short = [torch.arange(3, 6), torch.arange(7, 10)]
    for got, want in zip(_run(lm, used, short, None, 12), _run(lm, fresh, short, None, 12), strict=True):
        assert torch.equal(got, want)


def test_bytes_per_token_count_the_lsh_layers_alone() -> None:
    lm = _model(["local", "lsh", "local", "lsh"])
    cache = DecodeCache(lm, 0, 1, cpu_kernel=False)
    kv = 2 * 2 * 16 * 4  # a float32 key and value of 2 heads x 16
    index = LSHIndex.token_bytes(2, 2, 4096)  # 2 heads x 2 rounds of main order
    assert cache.bytes_per_token == 2 * (kv + 2 * 4 + index)  # keys and values, key factors, main order
    assert cache.ring.width == WINDOW and cache.ring_bytes_per_slot == 2 * WINDOW * kv
    assert cache.bytes_per_slot == cache.reserved_bytes_per_slot  # fixed buckets: all there from the start
    # every slot and the scratch slot hold a ring of each local layer, counted outside the budget's blocks
    used = sum(p.numel() * p.element_size() for li, p in enumerate(cache.kv) if cache.is_ring(li))
    assert used == 2 * cache.ring_bytes_per_slot


def test_crime_and_punishments_configuration_keeps_3120_bytes_per_token() -> None:
    """hidden 256, 2 heads x 64, local/lsh x 3, chunks of 64 with one before, float32: 6,192 bytes per token
    when every layer kept every position; 3 x 1,040 for the LSH layers alone, and 3 x 128 x 1,024 per slot."""
    lm = ReformerLM(ReformerConfig.from_hf(CRIME_AND_PUNISHMENT)).eval()
    cache = DecodeCache(lm, 0, 1, cpu_kernel=False)
    assert cache.bytes_per_token == 3120 and cache.ring.width == 128
    assert cache.ring_bytes_per_slot == 3 * 128 * 1024


def test_a_model_of_local_layers_alone_holds_no_bytes_per_token() -> None:
    lm = _model(["local", "local"], initializer_range=0.3)  # decoded within 1e-5 of the forward, as above
    cache = DecodeCache.for_tokens(lm, 60, slots=2)
    assert cache.bytes_per_token == 0 and cache.capacity_bytes == 2 * cache.reserved_bytes_per_slot
    assert cache.fits_ever(cache.max_tokens) and not cache.fits_ever(cache.max_tokens + 1)
    prompt = torch.arange(3, 30)
    logits, states = prefill(lm, cache, [prompt], [60])
    seq = prompt.tolist()
    decoder = Decoder(lm, cache)
    with torch.no_grad():
        for _ in range(20):
            seq.append(int(logits[0].argmax()))
            logits = decoder.step([seq[-1]], states)
            assert (lm(torch.tensor([seq])).logits[0, -1] - logits[0]).abs().max().item() <= 1e-5
    # a capacity that cannot hold the slots' rings admits nothing
    small = DecodeCache(lm, 3 * cache.reserved_bytes_per_slot - 1, 2, max_tokens=60)
    with pytest.raises(CacheFull) as refused:
        small.allocate(10)
    assert refused.value.never
