"""model/ngram_keys.py and `ReformerConfig.lsh_key_conv_width`: the causal depthwise convolution before an LSH
layer's query/key projection starts as the identity (a model given one computes what it did), never reads a
later position, is trained through (it gets gradients), and every path that reads `query_key` directly
refuses a model with one, naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from export.artifact import save_artifact
from export.onnx_export import export_onnx
from model.decoding.cache import DecodeCache
from model.ngram_keys import CausalDepthwiseConv
from model.reformer import ReformerLM
from tests.conftest import tiny_config, tiny_model
from train.checkpoint import load_init_weights


def _with_key_conv(width: int = 3) -> tuple[ReformerLM, ReformerLM]:
    plain = tiny_model(seed=1)
    conv = ReformerLM(tiny_config(lsh_key_conv_width=width)).eval()
    load_init_weights(conv, plain)
    return plain, conv


def test_identity_at_start_leaves_the_model_unchanged() -> None:
    plain, conv = _with_key_conv()
    assert sum(".key_conv." in k for k in conv.state_dict()) == plain.config.attn_layers.count("lsh")
    x = torch.randint(2, 258, (2, 80))
    with torch.no_grad():
        assert torch.equal(conv(x).logits, plain(x).logits)


def test_the_key_convolution_trains_and_changes_the_keys() -> None:
    _, conv = _with_key_conv()
    conv.train()
    x = torch.randint(2, 258, (1, 64))
    loss = conv(x).logits.logsumexp(-1).mean()
    loss.backward()
    grads = [p.grad for n, p in conv.named_parameters() if ".key_conv." in n]
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)


def test_logits_never_read_a_later_position() -> None:
    _, conv = _with_key_conv()
    with torch.no_grad():
        for p in (p for n, p in conv.named_parameters() if ".key_conv." in n):
            p.normal_()  # no longer the identity: every tap mixes
        x = torch.randint(2, 258, (1, 8))
        later = x.clone()
        later[0, 5:] = (later[0, 5:] + 7) % 256 + 2
        # one chunk of 8: the causal dense path, so no bucket layout can move with the later bytes
        assert torch.equal(conv(later).logits[0, :5], conv(x).logits[0, :5])
        assert not torch.equal(conv(later).logits[0, 5:], conv(x).logits[0, 5:])


def test_convolution_is_causal_and_mixes_the_last_width_positions() -> None:
    conv = CausalDepthwiseConv(4, 3)
    with torch.no_grad():
        conv.weight.copy_(torch.arange(12.0).view(4, 1, 3))
    x = torch.randn(1, 10, 4)
    y = conv(x)
    later = x.clone()
    later[0, 6:] += 1.0
    assert torch.equal(conv(later)[0, :6], y[0, :6])  # positions before 6 never see 6 or later
    t, c = 5, 2  # y[t] = w0 x[t-2] + w1 x[t-1] + w2 x[t]
    want = 6.0 * x[0, t - 2, c] + 7.0 * x[0, t - 1, c] + 8.0 * x[0, t, c]
    assert torch.allclose(y[0, t, c], want)
    assert torch.allclose(y[0, 0, c], 8.0 * x[0, 0, c])  # zeros before the first position


def test_paths_that_read_the_projection_directly_refuse_it(tmp_path: Path) -> None:
    _, conv = _with_key_conv()
    with pytest.raises(ValueError, match="lsh_key_conv_width=3: cached decoding"):
        DecodeCache(conv, 1 << 20, 2)
    with pytest.raises(ValueError, match="lsh_key_conv_width=3: ONNX export"):
        export_onnx(conv, tmp_path / "model.onnx")
    with pytest.raises(ValueError, match="lsh_key_conv_width=3: an artifact"):
        save_artifact(conv, tmp_path / "artifact", onnx=False)
    assert not (tmp_path / "artifact").exists()
    with pytest.raises(ValueError, match="lsh_key_conv_width=3: transformers"):
        conv.config.to_hf()


@pytest.mark.parametrize("width", [-1, 2.5, True])
def test_a_bad_width_is_refused(width: object) -> None:
    with pytest.raises(ValueError, match="lsh_key_conv_width must be an integer >= 0"):
        tiny_config(lsh_key_conv_width=width)
