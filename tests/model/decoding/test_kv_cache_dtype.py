"""A decode cache that keeps keys and values in bfloat16 or float16 (DecodeCache(kv_dtype=...)): the C kernel
reads half rows exactly as their float32 widening (both of its paths: widened in registers for head sizes
that are multiples of 16, through a buffer otherwise), writes round as `Tensor.to` rounds, decoding through
the kernel equals the PyTorch path, a row's result does not depend on its batch, the byte accounting halves
the keys and values, and a whole decode stays within a bound of the float32 cache.

Bounds: the kernel and the PyTorch path agree within 1e-5 on one step's attention (the same float32
arithmetic on the same widened values). Over 12 decode steps their logits drift apart: the kernel path's layer
norms are computed in C, whose rounding differs from PyTorch's in the last bits, and a key that differs in its
last float32 bit can round to a neighbouring half value, which later steps read. Measured at most 5.8e-4
(float16) and 2.6e-4 (bfloat16) on these tiny models with logits up to ~9, bound MAX_PATH_DRIFT (9.4e-5 when
the kernel path took PyTorch's layer norms). Against the float32 cache, with logits of magnitude up to ~10:
float16 (11 significant bits) measured at most 3.4e-3, bfloat16 (8 bits) 0.12, bounds MAX_CACHE_DRIFT; every
greedy token agreed.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from model import ReformerLM
from model.chunking import mask_value, self_mask_value
from model.decoding import DecodeCache, Decoder, prefill
from model.kernels import CpuKernels, build

from ..helpers import tiny_config
from ..kernels.test_cpu_kernels import _inputs, _plain_attention

HALF = [torch.float16, torch.bfloat16]
MAX_PATH_DRIFT = {torch.float16: 1e-3, torch.bfloat16: 1e-3}
MAX_CACHE_DRIFT = {torch.float16: 1e-2, torch.bfloat16: 0.3}


@pytest.fixture(scope="module")
def kernel() -> CpuKernels:
    k = build.kernels()
    assert k is not None, "the C window kernel did not build (is a C compiler installed?)"
    if torch.float16 not in k.reads:  # every x86-64 CPU of the last decade has F16C; CI's does
        pytest.fail(f"this kernel build reads only {sorted(map(str, k.reads))}")
    return k


def _model(layers: list[str], head_size: int = 16) -> ReformerLM:
    torch.manual_seed(0)
    return ReformerLM(tiny_config(vocab_size=258, attn_layers=layers, num_buckets=4, initializer_range=0.3,
                                  num_hashes=4, attention_head_size=head_size)).eval()


def _decode(lm: ReformerLM, kv_dtype: torch.dtype | None, cpu_kernel: bool, lengths: list[int], steps: int = 12
            ) -> torch.Tensor:
    cache = DecodeCache.for_tokens(lm, max(lengths) + steps + 1, slots=len(lengths), recent=4,
                                   cpu_kernel=cpu_kernel, kv_dtype=kv_dtype)
    decoder = Decoder(lm, cache)
    assert (cache.kernel is not None) == cpu_kernel
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 258, (n,), generator=g) for n in lengths]
    with torch.no_grad():
        first, states = prefill(lm, cache, prompts, [n + steps + 1 for n in lengths])
        token, out = first.argmax(-1), [first]
        for _ in range(steps):
            logits = decoder.step(token, states)
            out.append(logits)
            token = logits.argmax(-1)
    return torch.stack(out)


@pytest.mark.parametrize("dtype", HALF, ids=["float16", "bfloat16"])
# 20: rows widened through a buffer; 32: widened in registers, the output summed in registers; 96 (as the
# enwik8 shape's 128): widened in registers, the output summed in memory
@pytest.mark.parametrize("d", [20, 32, 96], ids=["widened-through-a-buffer", "widened-in-registers",
                                                 "output-in-memory"])
def test_half_pools_attend_as_their_float32_values(kernel: CpuKernels, dtype: torch.dtype,
                                                   d: int) -> None:
    x = _inputs(d=d)
    half = dict(x, keys=x["keys"].to(dtype), values=x["values"].to(dtype))
    widened = dict(x, keys=half["keys"].float(), values=half["values"].float())
    masks: dict[str, Any] = dict(self_mask=self_mask_value(torch.float32), mask=mask_value(torch.float32))
    got = kernel.attend(**half, **masks)
    torch.testing.assert_close(got, _plain_attention(**widened), atol=1e-5, rtol=1e-5)
    # and the rounding matters: the same attention over the float32 values is another result
    assert (got - _plain_attention(**x)).abs().max().item() > 1e-4
    with pytest.raises(ValueError, match="key and value pools of"):
        kernel.attend(**dict(half, values=x["values"]), **masks)


@pytest.mark.parametrize("dtype", HALF, ids=["float16", "bfloat16"])
def test_a_step_write_rounds_as_tensor_to_rounds(kernel: CpuKernels, dtype: torch.dtype) -> None:
    lm = _model(["local", "lsh"])
    plain = DecodeCache.for_tokens(lm, 40, cpu_kernel=False, kv_dtype=dtype)
    fused = DecodeCache.for_tokens(lm, 40, kv_dtype=dtype)
    assert fused.kernel is not None and fused.keys[0].dtype == dtype and fused.norms[1] is not None
    g = torch.Generator().manual_seed(0)
    rows = torch.tensor([9, 30, 17])
    key = torch.randn(3, plain.heads, plain.head_size, generator=g) * 4
    value = torch.randn(3, plain.heads, plain.head_size, generator=g)
    # halfway cases (round to even), float16's overflow to infinity, and a NaN
    key[0, 0, :4] = torch.tensor([1 + 2**-11, 1 + 3 * 2**-11, 70000.0, float("nan")])
    value[0, 0, :2] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8])
    for layer in (0, 1):
        plain.write(layer, rows, key, value)
        fused.write_step(layer, rows, key, value)
        for a, b in ((plain.keys[layer][rows], fused.keys[layer][rows]),
                     (plain.values[layer][rows], fused.values[layer][rows])):
            # the same values (a NaN's payload may differ: PyTorch's vectorised bfloat16 cast writes 0xffff)
            torch.testing.assert_close(a, b, atol=0, rtol=0, equal_nan=True)
    # the key factor is taken from the float32 key, not from its rounding
    norms = fused.norms[1]
    assert norms is not None and norms.dtype == torch.float32
    torch.testing.assert_close(norms[rows[1:]], plain.norms[1][rows[1:]], atol=0, rtol=1e-6)  # type: ignore[index]


@pytest.mark.parametrize("dtype", HALF, ids=["float16", "bfloat16"])
@pytest.mark.parametrize("layers", [["local", "lsh", "local", "lsh"], ["lsh", "lsh"]], ids=["mix", "lsh2"])
def test_decoding_a_half_cache_through_the_kernel_equals_the_pytorch_path(dtype: torch.dtype,
                                                                          layers: list[str]) -> None:
    lm = _model(layers)
    lengths = [3, 8, 29, 70]  # dense rows, one crossing a chunk, merges of the recent order every 4 steps
    fused = _decode(lm, dtype, True, lengths)
    plain = _decode(lm, dtype, False, lengths)
    assert torch.equal(fused.argmax(-1), plain.argmax(-1))
    assert (fused - plain).abs().max().item() <= MAX_PATH_DRIFT[dtype]


@pytest.mark.parametrize("dtype", HALF, ids=["float16", "bfloat16"])
def test_a_half_cache_stays_near_the_float32_cache(dtype: torch.dtype) -> None:
    lm = _model(["local", "lsh", "local", "lsh"], head_size=32)
    lengths = [5, 40, 90]
    full = _decode(lm, None, True, lengths)
    half = _decode(lm, dtype, True, lengths)
    drift = (half - full).abs().max().item()
    assert 0 < drift <= MAX_CACHE_DRIFT[dtype]
    assert torch.equal(half.argmax(-1), full.argmax(-1))
    assert torch.equal(half[0], full[0])  # the prefill's logits never read the cache


@pytest.mark.parametrize("dtype", HALF, ids=["float16", "bfloat16"])
def test_a_row_of_a_half_cache_gets_the_same_bits_alone_and_batched(dtype: torch.dtype) -> None:
    lm = _model(["local", "lsh", "local", "lsh"])
    cache = DecodeCache.for_tokens(lm, 90, slots=3, kv_dtype=dtype)
    decoder = Decoder(lm, cache)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 258, (n,), generator=g) for n in (70, 12, 45)]
    with torch.no_grad():
        _, states = prefill(lm, cache, prompts, [90] * 3)
        alone_cache = DecodeCache.for_tokens(lm, 90, slots=1, kv_dtype=dtype)
        alone_decoder = Decoder(lm, alone_cache)
        _, alone_states = prefill(lm, alone_cache, prompts[:1], [90])
        tokens = torch.tensor([5, 6, 7])
        for _ in range(6):  # invariant mode: fixed row blocks, so the linear layers give every row its bits
            batched = decoder.step(tokens, states, invariant=True)
            alone = alone_decoder.step(tokens[:1], alone_states, invariant=True)
            assert torch.equal(batched[0], alone[0])
            tokens = batched.argmax(-1)


def test_bytes_per_token_count_half_keys_and_values() -> None:
    lm = _model(["local", "lsh", "local", "lsh"])
    full, half = DecodeCache.for_tokens(lm, 64), DecodeCache.for_tokens(lm, 64, kv_dtype=torch.bfloat16)
    cfg = lm.config
    # per token: the LSH layers' keys and values (a local layer's are in its ring, counted per slot)
    kv_elements = 2 * cfg.attn_layers.count("lsh") * cfg.num_attention_heads * cfg.attention_head_size
    assert full.bytes_per_token - half.bytes_per_token == kv_elements * 2  # 4 bytes each, then 2
    ring = 2 * cfg.attn_layers.count("local") * cfg.num_attention_heads * cfg.attention_head_size * full.ring.width
    assert full.ring_bytes_per_slot - half.ring_bytes_per_slot == ring * 2
    assert half.keys[0].element_size() == 2 and half.norms[1] is not None and half.norms[1].dtype == torch.float32


def test_what_a_cache_cannot_keep_is_refused() -> None:
    lm = _model(["local", "lsh"])
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        DecodeCache.for_tokens(lm, 32, kv_dtype=torch.float64)
    half_model = _model(["local", "lsh"]).to(torch.bfloat16)
    with pytest.raises(ValueError, match="needs a float32 model"):
        DecodeCache.for_tokens(half_model, 32, kv_dtype=torch.float16)
    assert DecodeCache.for_tokens(half_model, 32).kv_dtype == torch.bfloat16
