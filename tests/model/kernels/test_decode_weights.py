"""The decode step's products over bfloat16 and int8 weights (model/kernels/csrc/step_linear_q.c,
model/kernels/weights.py): against float64 products of the same rounded weights, within the rounding's bound
of the float32 product, a row's bits independent of the batch, the plain-C build giving the same results, and an
unknown kind refused."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from model.kernels import CpuKernels, abi, build
from model.kernels.weights import pack_weights, packed_bytes, quantize

QUANTISED = ("bfloat16", "int8")
SHAPES = [(1024, 256), (258, 512), (33, 17), (7, 3), (32, 64)]


def _product(fn: ctypes._CFuncPtr, kind: str, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None
             ) -> torch.Tensor:
    """x (m, k) times w (n, k) packed as `kind`, through step_linear_w `fn`."""
    m, k = x.shape
    n = w.shape[0]
    packed = pack_weights(w, kind)  # type: ignore[arg-type]
    assert packed.numel() == packed_bytes(kind, n, k)  # type: ignore[arg-type]
    out = torch.full((m, n), float("nan"))
    status = fn(abi.WEIGHTS[kind], m, n, k, x.data_ptr(), k, packed.data_ptr(), 0 if b is None else b.data_ptr(),
                out.data_ptr())
    assert status == 0
    return out


def _reference(kind: str, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """float64 x times the weights as `kind` keeps them (int8: x q^T, then times each column's scale)."""
    values, scale = quantize(w, kind)  # type: ignore[arg-type]
    y = x.double() @ values.double().T
    if scale is not None:
        y = y * scale.double()
    return y if b is None else y + b.double()


@pytest.mark.parametrize("kind", QUANTISED)
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_the_product_is_the_rounded_weights_product(kernel: CpuKernels, kind: str, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(n * 1000 + k)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    for m, bias in ((1, b), (5, None), (8, b), (9, b), (20, None)):
        x = torch.randn(m, k, generator=g)
        out = _product(kernel.linear_w_raw, kind, x, w, bias)
        ref = _reference(kind, x, w, bias)
        # float32 sums of k products, as the float32 kernel's (tests/model/decoding/test_step_linear.py)
        assert torch.allclose(out.double(), ref, rtol=1e-5, atol=4e-6 * k**0.5), (out.double() - ref).abs().max()


@pytest.mark.parametrize("kind", QUANTISED)
def test_the_product_is_within_the_roundings_bound_of_float32(kernel: CpuKernels, kind: str) -> None:
    """bfloat16 moves a weight by at most 2^-9 of itself; int8 by at most half its column's scale,
    max |w| / 254: the product moves by at most that times sum |x| |w| (or sum |x| max |w|)."""
    g = torch.Generator().manual_seed(3)
    w, b, x = torch.randn(300, 200, generator=g), torch.randn(300, generator=g), torch.randn(6, 200, generator=g)
    exact = x.double() @ w.double().T + b.double()
    out = _product(kernel.linear_w_raw, kind, x, w, b).double()
    if kind == "bfloat16":
        bound = (x.double().abs() @ w.double().abs().T) * 2.0**-9
    else:
        bound = x.double().abs().sum(1, keepdim=True) * (w.double().abs().amax(1) / 254)
    slack = 1e-4  # the float32 sums' own rounding
    assert ((out - exact).abs() <= bound + slack).all()
    assert (out - exact).abs().max() > 1e-3  # and the weights were rounded: this is no float32 product


@pytest.mark.parametrize("kind", QUANTISED)
def test_a_rows_bits_do_not_depend_on_the_batch(kernel: CpuKernels, kind: str) -> None:
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(300, 96, generator=g), torch.randn(300, generator=g)
    x = torch.randn(19, 96, generator=g)  # two full tiles of 8 rows and a remainder of 3
    batched = _product(kernel.linear_w_raw, kind, x, w, b)
    alone = torch.cat([_product(kernel.linear_w_raw, kind, x[i : i + 1].contiguous(), w, b) for i in range(19)])
    assert torch.equal(batched, alone)


def test_int8_scales_are_per_column_and_a_zero_column_stays_zero() -> None:
    w = torch.tensor([[0.5, -1.0, 0.25], [0.0, 0.0, 0.0], [3.0, 1.5, -3.0]])
    q, scale = quantize(w, "int8")
    assert scale is not None and torch.allclose(scale, torch.tensor([1.0, 0.0, 3.0]) / 127)
    assert torch.equal(q[0], torch.tensor([64.0, -127.0, 32.0])) and not q[1].any()
    assert q.abs().max() <= 127


def test_an_unknown_kind_is_refused(kernel: CpuKernels) -> None:
    x, out = torch.randn(1, 8), torch.empty(1, 4)
    packed = kernel.pack(torch.randn(4, 8))
    assert kernel.linear_w_raw(7, 1, 4, 8, x.data_ptr(), 8, packed.data_ptr(), 0, out.data_ptr()) == abi.BAD_KIND
    with pytest.raises(ValueError, match="int4"):
        quantize(torch.randn(2, 2), "int4")  # type: ignore[arg-type]


def test_the_plain_c_build_gives_the_same_products(kernel: CpuKernels, tmp_path: Path) -> None:
    """The build without AVX2 (plain C loops) computes the same chains of multiply-adds as the AVX2 loops
    (compiled for this CPU less AVX2, so the compiler fuses them as the AVX2 loops do: the same bits)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    assert compiler is not None
    lib_path = tmp_path / "step_linear_q_plain.so"
    sources = [s for s in build.SOURCES if s.name in ("step_linear.c", "step_linear_q.c")]
    subprocess.run([compiler, *build.COMMON_FLAGS, "-march=native", "-mno-avx2", "-mno-avx512f", "-shared",
                    *map(str, sources), "-o", str(lib_path)], check=True)
    fn = ctypes.CDLL(str(lib_path)).step_linear_w
    fn.argtypes = [ctypes.c_int64] * 4 + [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 3
    fn.restype = ctypes.c_int
    g = torch.Generator().manual_seed(6)
    w, b, x = torch.randn(70, 48, generator=g), torch.randn(70, generator=g), torch.randn(11, 48, generator=g)
    for kind in QUANTISED:
        plain, fast = _product(fn, kind, x, w, b), _product(kernel.linear_w_raw, kind, x, w, b)
        assert torch.equal(plain, fast), (kind, (plain - fast).abs().max())
