"""The C window kernel (model/kernels/bindings.py) computes what the PyTorch path of a decode step computes: its
attention against the plain formula, whole decode runs against the PyTorch path (mixed lengths joining,
rows still attending densely, merges of the recent order, automatic bucket counts that rebuild the index),
a row's result whatever it is batched with or however many threads run it, and the ways it is turned off."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from model import ReformerLM
from model.chunking import mask_value, self_mask_value
from model.decoding import DecodeCache, Decoder, prefill
from model.kernels import CpuKernels, build

from ..helpers import decode_greedily, tiny_config


@pytest.fixture(scope="module")
def kernel() -> CpuKernels:
    k = build.kernels()
    assert k is not None, "the C window kernel did not build (is a C compiler installed?)"
    return k


def _plain_attention(q: torch.Tensor, keys: torch.Tensor, norms: torch.Tensor | None, values: torch.Tensor,
                     flat: torch.Tensor, absent: torch.Tensor, pos: torch.Tensor | None, t: torch.Tensor | None,
                     dead: torch.Tensor | None) -> torch.Tensor:
    b, h, r, w = flat.shape
    # in float32, as the PyTorch path and the reference: a round that sees only its own position has a
    # log-sum-exp near -1e5, where float32 steps are 0.008, which its weight inherits
    dots = torch.einsum("bhd,bhrwd->bhrw", q, keys[flat])
    if norms is not None:
        dots = dots * norms[flat]
    if pos is not None:
        assert t is not None
        dots = dots.masked_fill(pos == t.view(b, 1, 1, 1), self_mask_value(torch.float32))
    dots = dots.masked_fill(absent.expand(b, h, r, w), mask_value(torch.float32))
    lse = torch.logsumexp(dots, dim=-1, keepdim=True)  # (B, H, R, 1)
    if dead is not None:
        lse = lse.masked_fill(dead.view(b, 1, r, 1), -torch.inf)
    weights = torch.exp(lse - torch.logsumexp(lse, dim=2, keepdim=True))
    probs = torch.exp(dots - torch.logsumexp(dots, dim=-1, keepdim=True)) * weights
    return torch.einsum("bhrw,bhrwd->bhd", probs, values[flat])


def _inputs(b: int = 5, h: int = 3, r: int = 4, w: int = 24, d: int = 20, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    n = 300
    t = torch.randint(0, 50, (b,), generator=g)
    pos = torch.randint(0, 50, (b, h, r, w), generator=g)
    pos[:, :, :, 0] = t.view(b, 1, 1)  # every window holds the row's own position somewhere
    absent = torch.rand(b, h, r, w, generator=g) < 0.3
    absent[0, 0, r - 1, 1:] = True  # a round that sees only its own position (the self mask decides its weight)
    absent[1, 0, :, 1:] = True  # a head whose every round sees only itself
    absent[:, :, :, 0] = False
    return dict(q=torch.randn(b, h, d, generator=g) * 3, keys=torch.randn(n, d, generator=g),
                norms=torch.rand(n, generator=g) + 0.5, values=torch.randn(n, d, generator=g),
                flat=torch.randint(0, n, (b, h, r, w), generator=g), absent=absent,
                pos=pos, t=t, dead=None)


@pytest.mark.parametrize("d", [20, 64])
def test_pools_with_each_key_beside_its_value_read_as_separate_pools(kernel: CpuKernels,
                                                                    d: int) -> None:
    """The decode cache keeps a (position, head)'s key and value side by side (rows 2 * d apart): the kernel
    reads such views as it reads two contiguous pools, bit for bit."""
    x = _inputs(d=d)
    kv = torch.stack([x["keys"], x["values"]], dim=1)  # (N, 2, d)
    masks: dict[str, Any] = dict(self_mask=self_mask_value(torch.float32), mask=mask_value(torch.float32))
    apart = kernel.attend(**x, **masks)
    beside = kernel.attend(**dict(x, keys=kv[:, 0], values=kv[:, 1]), **masks)
    assert kv[:, 0].stride() == (2 * d, 1)
    assert torch.equal(beside, apart)


# head sizes through each of the kernel's float32 loops: 20 the generic ones; 48 the output summed in
# registers; 64 that and the two-chain dot product; 160 the dot product with the generic output loop
# widths: 24 takes the softmax's one-slot-at-a-time expf (exp8, 8 at a time, in the AVX2 build), 32 (a
# multiple of 16) exp16's 16 at a time
@pytest.mark.parametrize("w", [24, 32])
@pytest.mark.parametrize("d", [20, 48, 64, 160])
def test_window_attention_equals_the_plain_formula(kernel: CpuKernels, d: int, w: int) -> None:
    # the float32 formula's own rounding grows with its dot products (~sqrt(d)): at d=160 it is 1.4e-5 from
    # the kernel, which is 1.3e-6 from the same formula in float64 (measured by hand)
    tol = 1e-5 * max(1.0, (d / 64) ** 0.5)
    x = _inputs(d=d, w=w)
    got = kernel.attend(**x, self_mask=self_mask_value(torch.float32), mask=mask_value(torch.float32))
    torch.testing.assert_close(got, _plain_attention(**x), atol=tol, rtol=1e-5)
    # local layers: no key factors, no self mask, padding shared by the heads, one round
    y = _inputs(r=1, d=d)
    y.update(norms=None, pos=None, t=None, absent=y["absent"][:, :1].clone())
    got = kernel.attend(**y, self_mask=0.0, mask=mask_value(torch.float32))
    torch.testing.assert_close(got, _plain_attention(**y), atol=tol, rtol=1e-5)
    # dead rounds weigh exactly nothing
    z = _inputs(seed=3, d=d)
    z["dead"] = torch.tensor([[False, True, True, True]] * 5)
    got = kernel.attend(**z, self_mask=self_mask_value(torch.float32), mask=mask_value(torch.float32))
    alive = dict(z, flat=z["flat"][:, :, :1], absent=z["absent"][:, :, :1], pos=z["pos"][:, :, :1], dead=None)
    torch.testing.assert_close(got, _plain_attention(**alive), atol=tol, rtol=1e-5)


def test_slots_scored_sixteen_at_a_time_get_the_bits_of_slots_scored_alone(kernel: CpuKernels) -> None:
    # float32 rows of a multiple of 32 elements and half rows of a multiple of 16: the n = R * W slots of a
    # (row, head)'s windows are scored 16 at a time, the last n % 16 one at a time. Two rounds of 21 slots
    # (42: two blocks of 16 and 10 alone); 15 absent slots in front of each round's window (absent slots weigh
    # exactly 0, and the sums over them add exact zeros) make 72 (four blocks and 8 alone) and move slots
    # between the two ways; the output keeps its bits only if both score every slot alike. (Both widths, 21
    # and 36, take the softmax's one-slot-at-a-time exp: a width of a multiple of 16, or of 8 in the AVX2
    # build, takes exp16 or exp8, other bits.)
    masks: dict[str, Any] = dict(self_mask=self_mask_value(torch.float32), mask=mask_value(torch.float32))
    cases = [(torch.float32, 32), (torch.float32, 64)]
    cases += [(dtype, d) for dtype in (torch.bfloat16, torch.float16) if dtype in kernel.reads for d in (16, 48)]
    for dtype, d in cases:
        for seed in range(3):
            x = _inputs(b=4, h=3, r=2, w=21, d=d, seed=seed)
            x.update(keys=x["keys"].to(dtype), values=x["values"].to(dtype))
            pad = (4, 3, 2, 15)
            padded = dict(x, flat=torch.cat([torch.zeros(pad, dtype=torch.long), x["flat"]], -1),
                          absent=torch.cat([torch.ones(pad, dtype=torch.bool), x["absent"]], -1),
                          pos=torch.cat([torch.zeros(pad, dtype=torch.long), x["pos"]], -1))
            assert torch.equal(kernel.attend(**padded, **masks), kernel.attend(**x, **masks))


def test_a_row_gets_the_same_bits_whatever_its_batch_and_threads(kernel: CpuKernels) -> None:
    x = _inputs(b=24)  # 72 (row, head) items: two threads take 36 each (a thread per 32 items at most)
    masks: dict[str, Any] = dict(self_mask=self_mask_value(torch.float32), mask=mask_value(torch.float32))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        batched = kernel.attend(**x, **masks)
        torch.set_num_threads(2)
        threaded = kernel.attend(**x, **masks)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(batched, threaded)
    for i in (0, 5):
        alone = dict(x, q=x["q"][i : i + 1], flat=x["flat"][i : i + 1], absent=x["absent"][i : i + 1],
                     pos=x["pos"][i : i + 1], t=x["t"][i : i + 1])
        assert torch.equal(kernel.attend(**alone, **masks)[0], batched[i])


@pytest.mark.parametrize("buckets", [4, None], ids=["fixed-buckets", "automatic-buckets"])
@pytest.mark.parametrize("layers,positions", [(["local", "lsh", "local", "lsh"], 4096), (["lsh", "lsh"], 4096),
                                              (["lsh", "lsh"], 2**17)], ids=["mix", "lsh2", "lsh2-int32-index"])
def test_decoding_through_the_kernel_equals_the_pytorch_path(layers: list[str], positions: int,
                                                             buckets: int | None) -> None:
    # past 2**16 positions the index stores positions as int32, not int16
    torch.manual_seed(0)
    axial = (64, 64) if positions == 4096 else (256, 512)
    lm = ReformerLM(tiny_config(vocab_size=258, attn_layers=layers, num_buckets=buckets, initializer_range=0.3,
                                num_hashes=4, max_position_embeddings=positions, axial_pos_shape=axial)).eval()
    # 3 and 6 tokens start shorter than a chunk (dense), 8 crosses it while decoding; merges every 4 steps
    lengths = [3, 6, 8, 29, 70]
    fused = decode_greedily(lm, lengths, 20, cpu_kernel=True, recent=4)
    plain = decode_greedily(lm, lengths, 20, cpu_kernel=False, recent=4)
    if positions > 2**16:
        assert DecodeCache.for_tokens(lm, 8).indexes[0].items.dtype == torch.int32  # type: ignore[union-attr]
    assert torch.equal(fused.argmax(-1), plain.argmax(-1))
    assert (fused - plain).abs().max().item() <= 1e-5


def test_the_kernel_can_be_turned_off_or_be_missing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """off: no kernels; a source checkout without an installed build and without a compiler falls back (it
    does not raise); with a compiler it builds one at first use."""
    lm = ReformerLM(tiny_config()).eval()
    try:
        build.load.cache_clear()
        monkeypatch.setenv(build.ENV_SWITCH, "off")
        assert build.load().kernels is None and build.load().source == "off"
        assert DecodeCache.for_tokens(lm, 32).kernel is None
        build.load.cache_clear()
        monkeypatch.setenv(build.ENV_SWITCH, "auto")
        monkeypatch.setattr(build, "installed", lambda folder=build.HERE: {})  # a source checkout
        monkeypatch.setenv(build.ENV_DIR, str(tmp_path))
        monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
        status = build.load()
        assert status.kernels is None and status.source == "unavailable" and status.reason
        monkeypatch.delenv("CC")
        build.load.cache_clear()
        status = build.load()
        assert status.kernels is not None and status.source == "first-use build"
        assert status.kernels.path.parent == tmp_path
        assert DecodeCache.for_tokens(lm, 32).kernel is not None
        assert DecodeCache.for_tokens(lm, 32, cpu_kernel=False).kernel is None
    finally:
        build.load.cache_clear()


def test_a_new_build_prunes_all_but_the_newest_builds(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import os

    old = [tmp_path / f"reformer_kernels-{i:016x}.so" for i in range(6)]
    for i, path in enumerate(old):
        path.write_bytes(b"stale")
        os.utime(path, (1_000_000 + i, 1_000_000 + i))  # old[5] the newest of them
    other = tmp_path / "notes.txt"
    other.write_text("not a build")
    try:
        build.load.cache_clear()
        monkeypatch.setattr(build, "installed", lambda folder=build.HERE: {})
        monkeypatch.setenv(build.ENV_DIR, str(tmp_path))
        built = build.load().kernels
        assert built is not None
        kept = sorted(tmp_path.glob("reformer_kernels-*.so"))
        assert len(kept) == build.KEEP_BUILDS and built.path in kept
        assert set(kept) - {built.path} == set(old[-(build.KEEP_BUILDS - 1):])
        assert other.exists()
    finally:
        build.load.cache_clear()


def test_a_corrupt_index_raises_instead_of_reading_outside_the_cache(kernel: CpuKernels) -> None:
    x = _inputs()
    x["flat"][2, 1, 0, 0] = x["keys"].shape[0]  # one row past the pools, in a slot that is not padding
    with pytest.raises(IndexError, match="outside the decode cache"):
        kernel.attend(**x, self_mask=self_mask_value(torch.float32), mask=mask_value(torch.float32))
    lm = ReformerLM(tiny_config(vocab_size=258)).eval()
    cache = DecodeCache.for_tokens(lm, 40)
    decoder = Decoder(lm, cache)
    _, states = prefill(lm, cache, [torch.arange(3, 33)], [40])
    cache.block_table[states[0].slot, 1] = cache.blocks + 5  # a block past the pools
    with pytest.raises(IndexError, match="outside the decode cache"):
        decoder.step(torch.tensor([5]), states)


def test_a_step_writes_what_the_pytorch_write_writes(kernel: CpuKernels) -> None:
    lm = ReformerLM(tiny_config()).eval()
    plain, fused = DecodeCache.for_tokens(lm, 40, cpu_kernel=False), DecodeCache.for_tokens(lm, 40)
    assert fused.kernel is not None and plain.kernel is None
    g = torch.Generator().manual_seed(0)
    rows = torch.tensor([9, 30, 17])
    key, value = torch.randn(3, plain.heads, plain.head_size, generator=g) * 4, torch.randn(3, 2, 16, generator=g)
    for layer in (0, 1):  # local (no key factors), then LSH
        plain.write(layer, rows, key, value)
        fused.write_step(layer, rows, key, value)
        assert torch.equal(plain.keys[layer][rows], fused.keys[layer][rows])
        assert torch.equal(plain.values[layer][rows], fused.values[layer][rows])
        if plain.norms[layer] is not None:
            torch.testing.assert_close(fused.norms[layer][rows], plain.norms[layer][rows], atol=0, rtol=1e-6)
    with pytest.raises(IndexError, match="outside the decode cache"):
        fused.write_step(0, torch.tensor([fused.keys[0].shape[0]]), key[:1], value[:1])


def test_tensors_the_c_side_cannot_read_are_refused(kernel: CpuKernels) -> None:
    x = _inputs()
    masks: dict[str, Any] = dict(self_mask=self_mask_value(torch.float32), mask=mask_value(torch.float32))
    with pytest.raises(ValueError, match="contiguous torch.float32 CPU tensor, got torch.float64"):
        kernel.attend(**dict(x, q=x["q"].double()), **masks)
    with pytest.raises(ValueError, match="evenly spaced contiguous rows"):
        kernel.attend(**dict(x, keys=torch.randn(20, x["keys"].shape[0]).t()), **masks)
    with pytest.raises(ValueError, match="key and value pools with strides"):  # each its own row spacing
        kernel.attend(**dict(x, keys=torch.randn(x["keys"].shape[0], 40)[:, :20]), **masks)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_counting_sort_orders_positions_as_argsort(kernel: CpuKernels, threads: int) -> None:
    g = torch.Generator().manual_seed(9)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for series, length, count in ((1, 1, 1), (3, 50, 1), (16, 70000, 2048), (8, 300, 64), (2, 0, 4)):
            buckets = torch.randint(0, count, (series, length), generator=g)
            want = torch.argsort(buckets * length + torch.arange(length), dim=-1)
            assert torch.equal(kernel.lsh_order(buckets, count), want)
            if length:  # a non-contiguous view orders as its copy
                assert torch.equal(kernel.lsh_order(buckets.t().contiguous().t(), count), want)
    finally:
        torch.set_num_threads(before)
    for bad in (4, -1):
        with pytest.raises(ValueError, match="a bucket outside"):
            kernel.lsh_order(torch.tensor([[0, bad, 1]]), 4)
