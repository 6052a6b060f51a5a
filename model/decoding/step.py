"""The decoder: one batched decode step for every running request over a decode cache, and how its rows are
batched: padded to a batch bucket, or in fixed blocks of INVARIANT_ROWS where a row's bits would otherwise
depend on its batch. The cache stores; the decoder chooses once what computes its steps (model/decoding/steps/:
the fused C step, CUDA graphs of the PyTorch step, or the PyTorch step itself, with C products and windows
where they run) and holds it. `Decoder.extend` feeds one request several tokens in one call, with the bits one
step per token gives (model/decoding/extend.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from ..kernels.weights import WeightKind
from .cache import DecodeCache
from .cache_state import DecodeState
from .extend import extend as extend_request
from .facts import row_facts
from .index_upkeep import maintain_indexes
from .plan import first_lsh_layer
from .steps.backends import StepBackends
from .steps.cuda_graphs import StepGraphs
from .steps.torch_step import step_compute

if TYPE_CHECKING:
    from ..reformer import ReformerLM

INVARIANT_ROWS = 16


def batch_bucket(rows: int) -> int:
    """The padded row count of a step: a power of two up to 64, then a multiple of 64."""
    if rows <= 64:
        return 1 << max(rows - 1, 0).bit_length()
    return -(-rows // 64) * 64


class Decoder:
    """Runs decode steps of `lm` over `cache`: holds the step's backends, chosen once (`StepBackends.choose`;
    tests may replace `backends.fused` (None keeps the call per layer), `backends.linears` or
    `backends.window`). `weights`: what the C step's products keep the linear weights in, float32, bfloat16
    or int8 (model/decoding/steps/linear.py)."""

    def __init__(self, lm: ReformerLM, cache: DecodeCache, weights: WeightKind = "float32") -> None:
        self.lm, self.cache = lm, cache
        self.backends = StepBackends.choose(cache, weights)

    def rows_independent(self, threads: int | None = None) -> bool:
        """Whether a step on `threads` intra-op threads (None: the count now) computes each row alone, its bits
        independent of the batch: true when the C window kernel attends and the C product kernel runs the
        linear layers, layer norms, hashes and layer tails, which the per-layer path does on one thread
        (model/decoding/steps/linear.py); its remaining PyTorch ops (embeddings, sums) work row by row
        (tests/model/decoding/test_decode.py checks the whole step). The one-call step
        (model/decoding/steps/fused.py) computes each row alone on any thread count; this answers for the
        per-layer path, which it falls back to."""
        cache = self.cache
        return self.backends.window is not None and self.backends.linears.runs_kernel(cache.dtype, cache.device,
                                                                                      threads)

    def rows_per_call(self, rows: int, invariant: bool) -> int:
        """The most rows one model call of a step over `rows` rows holds: INVARIANT_ROWS in invariant mode
        unless the steps compute each row alone now (`rows_independent`), else all of them."""
        return INVARIANT_ROWS if self._in_blocks(invariant) else rows

    def _in_blocks(self, invariant: bool) -> bool:
        """Fixed blocks of INVARIANT_ROWS only where a row's bits would otherwise depend on the batch."""
        return invariant and not self.rows_independent()

    def describe(self) -> dict[str, str]:
        """Which code runs a step's parts (`StepBackends.describe`)."""
        return self.backends.describe()

    @torch.no_grad()
    def step(self, tokens: Tensor | Sequence[int], states: Sequence[DecodeState], invariant: bool = False,
             graphs: StepGraphs | None = None) -> Tensor:
        """Append tokens (B,) to the B requests; returns the logits (B, vocab) for the position after each.
        `tokens` may be host ints (the service's sampled tokens) or a tensor. With `graphs` (CUDA), steps it
        can capture replay CUDA graphs, with the same results (model/decoding/steps/cuda_graphs.py)."""
        lm, cache, backends = self.lm, self.cache, self.backends
        b = len(states)
        # host ints where the step can use them (a CPU tensor's values are on the host already; a device
        # tensor's stay there: reading them would be a sync)
        host = [int(t) for t in tokens] if not isinstance(tokens, Tensor) else (
            tokens.reshape(-1).tolist() if tokens.device.type == "cpu" else None)
        n = len(host) if host is not None else int(tokens.numel())  # type: ignore[union-attr]
        if n != b:
            raise ValueError(f"{n} tokens for {b} decoding states")
        for state in states:
            if state.slot < 0:
                raise ValueError("decoding a request whose cache was freed")
            if state.length >= lm.config.max_position_embeddings:
                raise ValueError(f"decoding past max_position_embeddings {lm.config.max_position_embeddings}")
            if state.length >= state.capacity * cache.block_size:
                raise ValueError(f"decoding past the {state.capacity * cache.block_size} positions reserved")
        maintain_indexes(lm, cache, states)
        if graphs is None and backends.fused is not None and host is not None:
            # the one-call step computes each row alone (same bits in any batch): exactly the batch's rows, no
            # padding to a batch bucket and no blocks, from host inputs (model/decoding/steps/fused.py)
            rows_meta, nbs = row_facts(lm, cache, states)
            logits = backends.fused.run(lm, cache, backends.window, host, rows_meta, bucket_groups(nbs))
            if logits is not None:
                for state in states:
                    state.length += 1
                return logits
        if host is not None:
            tokens = torch.tensor(host, dtype=torch.long, device=cache.device)
        assert isinstance(tokens, Tensor)
        tokens = tokens.reshape(-1).to(cache.device)
        size = INVARIANT_ROWS if self._in_blocks(invariant) else batch_bucket(b)
        out = []
        for start in range(0, b, size):
            part = list(states[start : start + size])
            out.append(_step_rows(lm, cache, backends, tokens[start : start + size], part, size, graphs)[: len(part)])
        for state in states:
            state.length += 1
        return torch.cat(out) if len(out) > 1 else out[0]

    def extend(self, state: DecodeState, tokens: Sequence[int], all_logits: bool = False) -> Tensor:
        """Append `tokens` to the one request `state` in one call; returns the logits (vocab,) after the last
        (`all_logits`: every token's, (S, vocab)), leaving the cache as one `step` per token leaves it, bit for
        bit (model/decoding/extend.py)."""
        return extend_request(self, state, tokens, all_logits)


def _step_rows(lm: ReformerLM, cache: DecodeCache, backends: StepBackends, tokens: Tensor,
               states: list[DecodeState], rows: int, graphs: StepGraphs | None = None) -> Tensor:
    """One step over `rows` rows: the states' rows, then padding rows on the scratch slot. With `graphs`, a
    step whose structure it can capture replays a CUDA graph (model/decoding/steps/cuda_graphs.py); others run
    eagerly."""
    pad = rows - len(states)
    cfg = lm.config
    first_lsh = first_lsh_layer(cfg)
    rows_meta, nbs = row_facts(lm, cache, states)
    nbs += [None] * pad
    # padding rows count as hashed (their results are dropped), so a batch of long rows skips the dense path
    rows_meta += [[cache.scratch_slot, 0, 1, 1, 1, cache.scratch_slot, 0]] * pad
    all_hashed = all(m[2] for m in rows_meta)
    meta = torch.tensor(rows_meta, dtype=torch.long)
    if pad:  # F.pad costs a few microseconds even when it adds nothing
        tokens = F.pad(tokens, (0, pad), value=cfg.pad_token_id)
    groups = bucket_groups(nbs)
    if graphs is not None:
        out = graphs.run(lambda t, m: step_compute(lm, cache, backends, t, m, all_hashed, groups, first_lsh),
                         tokens, meta, (rows, all_hashed, tuple(str(nb) for nb, _ in groups)), cache,
                         single_group=len(groups) <= 1 and all(sel is None for _, sel in groups))
        if out is not None:
            return out
    return step_compute(lm, cache, backends, tokens, meta.to(cache.device), all_hashed, groups, first_lsh)



def bucket_groups(nbs: list[int | list[int] | None]) -> list[tuple[int | list[int], list[int] | None]]:
    """The step's rows by the bucket count they hash with: (count, the rows; None: every row). Rows that keep
    no index (padding, or not hashing yet) may take any count: they append with weight 0 to the scratch
    slot and their window results are dropped or replaced by the dense path, so when the others share one
    count every row hashes with it, in one call over a fixed number of rows."""
    groups: dict[str, tuple[int | list[int], list[int]]] = {}
    for i, nb in enumerate(nbs):
        if nb is not None:
            groups.setdefault(str(nb), (nb, []))[1].append(i)
    if len(groups) == 1:
        return [(nb, None) for nb, _ in groups.values()]
    return [(nb, members) for nb, members in groups.values()]

