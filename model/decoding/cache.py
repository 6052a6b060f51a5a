"""The decode cache: keys and values of every running request in preallocated blocks (a paged KV cache, as
vLLM's), plus each LSH layer's bucket order (model/decoding/lsh_index.py): its main part in the same blocks, a
small fixed part per request slot.

Each LSH layer's keys, values, key factors and main bucket order live in one pool of `blocks` blocks of
`block_size` positions; a request owns a list of blocks (its row of `block_table`). A request reserves, when
it is admitted, the blocks for its prompt plus its `max_new_tokens`, so joining or leaving copies nobody's
cache and growing never copies. A local layer reads only the last positions of its window, so it keeps a
ring of those per slot instead (model/decoding/local_ring.py): its bytes are counted per slot, not per token.
Block 0 and the last slot are scratch: padding rows of a bucketed step read and write there.

Keys and values are kept in the model's dtype by default (`kv_dtype=None`), as the forward computes them. A
float32 model may keep them in bfloat16 or float16 instead (as vLLM's kv_cache_dtype): half the bytes of the
keys and values (the LSH bookkeeping and key factors are not halved), so about twice the tokens in the same
capacity, at the price of the rounding of every cached key and value (the key factors of LSH layers are
still taken from the unrounded key). tests/model/test_kv_cache_dtype.py bounds that difference on tiny
models, and bench/decode/decode_quality.py measures it on the shipped one.

With an automatic bucket count (num_buckets=None) the bucket counts grow, for every slot at once, when a
request reaches a length with more buckets. The budget therefore reserves, per slot, the counts of the
longest request the cache is built for (`max_tokens`), and refuses longer ones, so growth never takes memory
the capacity does not count.

On a Linux CPU the pools are mapped on transparent huge pages (model/decoding/huge_pages.py): a long request's windows
read rows scattered over the whole pool. A pool's page stays resident once written, so free blocks are handed
out lowest first (the running requests' blocks gather at the low end of the pools) and the cache keeps the
free blocks written since their pages were last given back (`take_releasable`): the owner gives those pages
back (service/engine/runner.py), and the pools' resident pages follow the blocks in use instead of the highest
number of blocks ever held at once.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from ..attention import LSHSelfAttention
from ..kernels import CpuKernels, kernels
from .block_allocator import BlockAllocator
from .cache_state import CacheFull, DecodeState, HashedAhead, KeptPrefix
from .huge_pages import pool_empty
from .local_ring import LocalRing, local_window_width
from .lsh_index import RECENT, BlockLookup, LSHIndex, recent_size_for
from .pool_rows import PoolRows

if TYPE_CHECKING:
    from ..reformer import ReformerLM


# positions per block: a request wastes under one block of its reservation (on average half); 8 keeps that
# under 1% of a 1K-token request's bytes. A step reads blocks through a flat lookup, so smaller blocks cost it
# nothing but a wider block table (8 bytes per block of the longest request, per slot)
BLOCK_SIZE = 8

# what cached keys and values may be kept in
KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def kv_dtype_for(model_dtype: torch.dtype, kv_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a cache keeps keys and values in: the model's for None; one of KV_DTYPES, and other than the
    model's only for a float32 model (ValueError otherwise)."""
    chosen = model_dtype if kv_dtype is None else kv_dtype
    if chosen not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {', '.join(str(d) for d in KV_DTYPES)}; got {chosen}")
    if chosen != model_dtype and model_dtype != torch.float32:
        raise ValueError(f"a {model_dtype} model keeps its cache in {model_dtype} (a separate kv_dtype needs a "
                         "float32 model)")
    return chosen


def store_kernel(device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype, cpu_kernel: bool = True
                 ) -> CpuKernels | None:
    """The C functions a cache writes its pools and sorts its LSH indexes with: for a float32 model on the CPU
    when `cpu_kernel` and they load and their build reads `kv_dtype` pools, else None (PyTorch ops)."""
    if not cpu_kernel or device.type != "cpu" or dtype != torch.float32:
        return None
    kernel = kernels()
    return kernel if kernel is not None and kv_dtype in kernel.reads else None


def flat_buckets(nb: int | list[int]) -> int:
    return nb if isinstance(nb, int) else math.prod(nb)


class DecodeCache(PoolRows):
    def __init__(self, lm: ReformerLM, capacity_bytes: int, max_slots: int, block_size: int = BLOCK_SIZE,
                 max_tokens: int | None = None, recent: int | None = None, cpu_kernel: bool = True,
                 kv_dtype: torch.dtype | None = None) -> None:
        """`recent`: the size of each LSH index's recent order (model/decoding/lsh_index.py; None: sized for
        `max_tokens` by `recent_size_for`; small in tests, so merges happen within a few steps). `cpu_kernel`: a
        float32 model's CPU cache writes its pools and sorts its indexes through the C kernels
        (model/kernels/bindings.py) when they can be built and read `kv_dtype` (`store_kernel`); False keeps
        PyTorch ops. `kv_dtype`: the dtype of cached keys and values (None: the model's; see the module
        docstring). What computes a step over the cache is the decoder's choice (model/decoding/step.py
        `Decoder`)."""
        cfg = lm.config
        cfg.refuse_key_conv("cached decoding")
        # the longest request (prompt plus new tokens) served: what an automatic bucket count is reserved for
        self.max_tokens = min(max_tokens or cfg.max_position_embeddings, cfg.max_position_embeddings)
        recent = recent_size_for(self.max_tokens) if recent is None else recent
        param = next(lm.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.kv_dtype = kv_dtype_for(self.dtype, kv_dtype)
        self.cpu_kernel = cpu_kernel  # whether the owner allows C kernels on this cache's data at all
        self.kernel = store_kernel(self.device, self.dtype, self.kv_dtype, cpu_kernel)
        self.block_size = block_size
        self.max_slots = max_slots
        self.heads, self.head_size = cfg.num_attention_heads, cfg.attention_head_size
        # per LSH layer (None for local ones): heads, rounds, the buckets its index starts with and the most it
        # can need
        specs: list[tuple[int, int, int, int] | None] = []
        for layer in lm.layers:
            att = layer.attention.self_attention  # type: ignore[union-attr]
            if isinstance(att, LSHSelfAttention):
                fixed = att.config.num_buckets
                most = flat_buckets(fixed if fixed is not None
                                    else att.num_buckets_for(cfg.padded_length(self.max_tokens)))
                specs.append((att.heads, att.rounds, flat_buckets(fixed) if fixed is not None else 2, most))
            else:
                specs.append(None)
        kv_elt, elt = torch.finfo(self.kv_dtype).bits // 8, torch.finfo(self.dtype).bits // 8
        positions = cfg.max_position_embeddings
        lsh = [spec for spec in specs if spec is not None]
        kv_bytes = 2 * self.heads * self.head_size * kv_elt  # one position's keys and values in one layer
        # per block position: LSH layers' keys and values, key factors and main bucket order (lsh_index.py)
        self.bytes_per_token = (len(lsh) * (kv_bytes + self.heads * elt)
                                + sum(LSHIndex.token_bytes(h, r, positions) for h, r, _, _ in lsh))
        # and, per block, a spare block of main order for forks (`fork`): the spare blocks are as many as the
        # blocks, so a block's bytes count one (the main order's share, 3% on the shipped model)
        self.order_bytes_per_block = sum(LSHIndex.token_bytes(h, r, positions) for h, r, _, _ in lsh) * block_size
        self.bytes_per_block = self.bytes_per_token * block_size + self.order_bytes_per_block
        # per slot: each local layer's ring of its window (local_ring.py), LSH indexes' fixed part at its largest
        self.ring = LocalRing(local_window_width(lm))
        self.ring_bytes_per_slot = (len(specs) - len(lsh)) * self.ring.width * kv_bytes
        self.reserved_bytes_per_slot = self.ring_bytes_per_slot + sum(
            LSHIndex.slot_bytes(h, r, most, positions, recent) for h, r, _, most in lsh)
        usable = capacity_bytes - self.reserved_bytes_per_slot * (max_slots + 1)
        if self.bytes_per_block:
            self.blocks = max(usable // self.bytes_per_block, 0) + 1  # + the scratch block 0
        else:  # no LSH layer: blocks hold no bytes; as many as every slot's longest request when the rings fit
            self.blocks = (max_slots * -(-self.max_tokens // block_size) if usable >= 0 else 0) + 1
        rows = self.blocks * block_size
        self.scratch_slot = max_slots
        # the widest bucket counts each LSH layer can reach (0 for local layers): what bounds a restored state's
        self.bucket_limits = [spec[3] if spec is not None else 0 for spec in specs]
        # each LSH index's main order has the rows of 2 * blocks - 1 blocks: rows of blocks 0..blocks-1 hold the
        # main order of the requests owning those blocks (order table row = block table row), rows of blocks
        # blocks..2*blocks-2 (the spare order blocks, one per block but the scratch one) hold a fork's own copy
        # of the order of the positions it shares (`fork`). Mapped as the pools are (huge_pages.py pool_empty):
        # a spare page is touched only when a fork writes it
        self.indexes: list[LSHIndex | None] = [
            None if spec is None else LSHIndex(max_slots + 1, spec[0], spec[1], spec[2], 2 * rows - block_size,
                                               self.device, positions, recent)
            for spec in specs]
        # empty, not zeros: pages are touched only when written (only the scratch block is cleared); a read
        # never reaches a position that was not written (windows point masked slots at position 0).
        # A (position, head)'s key and value side by side, one run of 2 * head_size: a window slot reads both,
        # and one run from memory is cheaper than two rows in two pools (in-process A/B of the step, scratch
        # script, load not recorded; bench config, 8 rows after 1K: 6.18 / 6.16 -> 5.39 / 5.56 ms;
        # bit-identical logits). keys and values
        # are views into it, each (rows, heads, head_size) with rows 2 * head_size elements apart.
        # A local layer's pool is its rings, slot by slot (the scratch slot's last): rows (max_slots + 1) * width.
        self.kv = [pool_empty((rows if ix is not None else (max_slots + 1) * self.ring.width, self.heads, 2,
                               self.head_size), self.kv_dtype, self.device)
                   for ix in self.indexes]
        self.keys = [kv[:, :, 0] for kv in self.kv]
        self.values = [kv[:, :, 1] for kv in self.kv]
        # LSH layers: each cached key's length-normalisation factor divided by sqrt(head size), so a step
        # scales its dot products instead of normalising every gathered key again
        self.norms = [pool_empty((rows, self.heads), self.dtype, self.device) if ix is not None
                      else None for ix in self.indexes]
        for pool in self.block_pools:
            pool[:block_size].zero_()
        scratch_ring = slice(self.scratch_slot * self.ring.width, (self.scratch_slot + 1) * self.ring.width)
        for li, kv in enumerate(self.kv):
            if self.indexes[li] is None:
                kv[scratch_ring].zero_()
        for ix in self.indexes:
            if ix is not None:
                ix.order[:block_size].fill_(ix.shift)  # position 0
        # a window's padding slots reach the padded length of the longest row, past max_position_embeddings
        # when that is not a multiple of the chunks' common length
        self.max_blocks = -(-cfg.padded_length(cfg.max_position_embeddings) // block_size)
        self.block_table = torch.zeros(max_slots + 1, self.max_blocks, dtype=torch.long, device=self.device)
        # where each slot's main bucket order lives, block by block as the block table (sorted index j of a slot's
        # main order at the order row of its position j through this table): the block table's own blocks for
        # every request, spare order blocks for the positions a fork shares with its parent (`fork`)
        self.order_table = torch.zeros_like(self.block_table)
        # who holds each block, which are free (handed out lowest first), which free ones have resident pages
        self.allocator = BlockAllocator(self.blocks)
        self._free_slots = list(range(max_slots - 1, -1, -1))
        # per slot: its request's keys hashed ahead of a bucket-count change (model/decoding/rehash_ahead.py)
        self.hashed_ahead: dict[int, HashedAhead] = {}

    @property
    def bytes_per_slot(self) -> int:
        """What one request slot holds outside the blocks now: the local layers' rings and the LSH indexes'
        fixed part. With an automatic bucket count the latter grows (for every slot) up to what
        `reserved_bytes_per_slot` counts, which the capacity counts."""
        return self.ring_bytes_per_slot + sum(ix.nbytes_per_slot() for ix in self.indexes if ix is not None)

    @property
    def block_pools(self) -> list[Tensor]:
        """The pools addressed through the block table (LSH layers' keys and values, and key factors): what
        `take_releasable`'s row ranges are rows of. The local layers' rings are not among them."""
        return [*(kv for kv, ix in zip(self.kv, self.indexes, strict=True) if ix is not None),
                *(n for n in self.norms if n is not None)]

    @classmethod
    def for_tokens(cls, lm: ReformerLM, tokens: int, slots: int = 1, block_size: int = BLOCK_SIZE,
                   recent: int = RECENT, cpu_kernel: bool = True, kv_dtype: torch.dtype | None = None
                   ) -> DecodeCache:
        """A cache just large enough for `slots` requests of `tokens` positions each."""
        probe = cls(lm, 0, slots, block_size, max_tokens=tokens, recent=recent, cpu_kernel=False, kv_dtype=kv_dtype)
        need = (slots * (-(-tokens // block_size) * probe.bytes_per_block + probe.reserved_bytes_per_slot)
                + probe.reserved_bytes_per_slot)
        return cls(lm, need, slots, block_size, max_tokens=tokens, recent=recent, cpu_kernel=cpu_kernel,
                   kv_dtype=kv_dtype)

    # ---- accounting --------------------------------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return (self.blocks - 1) * self.bytes_per_block + self.max_slots * self.reserved_bytes_per_slot

    @property
    def allocated_bytes(self) -> int:
        """Bytes held by requests: each block in use once (`bytes_per_block`, a spare order block's share
        included), however many requests share it, each spare order block forks use (counted again, as forks may
        use more of them than there are blocks in use), and the slots. So it can exceed `capacity_bytes` by up
        to the spare order blocks' share of the blocks (1.03x on the shipped model) when every spare order block
        is in use."""
        used_blocks = self.blocks - 1 - self.allocator.free_count
        used_orders = self.blocks - 1 - len(self.allocator.free_orders)
        return (used_blocks * self.bytes_per_block + used_orders * self.order_bytes_per_block
                + (self.max_slots - len(self._free_slots)) * self.bytes_per_slot)

    @property
    def free_blocks(self) -> int:
        return self.allocator.free_count

    @property
    def free_spare_orders(self) -> int:
        """Spare order blocks free: a fork takes one per block it shares (`fork`)."""
        return len(self.allocator.free_orders)

    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

    def bytes_for(self, tokens: int, shared: int = 0) -> int:
        """What a request of `tokens` positions takes from the cache; a fork sharing its first `shared` blocks
        with its parent (`fork`) takes only its own blocks and a spare order block per shared one."""
        return ((-(-tokens // self.block_size) - shared) * self.bytes_per_block + shared * self.order_bytes_per_block
                + self.reserved_bytes_per_slot)

    def shared_blocks(self, length: int) -> int:
        """How many leading blocks a fork of a state of `length` positions shares with it: the full blocks before
        the one holding its last position (that one is written again: a successor-value head's slot of the
        last position gets the value of the next)."""
        return max(length - 1, 0) // self.block_size

    def fits_ever(self, tokens: int) -> bool:
        return (-(-tokens // self.block_size) <= self.blocks - 1 and self.max_slots > 0
                and tokens <= self.max_tokens)

    def fits_now(self, tokens: int, shared: int = 0, kept: KeptPrefix | None = None) -> bool:
        """Whether `allocate(tokens, shared, kept)` can take what it needs now: with `kept`, those of its shared
        blocks that no request holds count among the free ones until then, so they come out of them too, and
        when none is held the state takes no spare order block (`allocate`)."""
        taken = int(self.allocator.is_free[kept.blocks[:shared]].sum()) if kept is not None else 0
        orders = 0 if kept is not None and taken == shared else shared
        return (-(-tokens // self.block_size) - shared + taken <= self.allocator.free_count
                and orders <= len(self.allocator.free_orders)
                and bool(self._free_slots))

    # ---- allocation --------------------------------------------------------------------------------------
    def allocate(self, tokens: int, shared: int = 0, kept: KeptPrefix | None = None) -> DecodeState:
        """A slot and the blocks for `tokens` positions (prompt plus new tokens), or CacheFull. `shared`: the
        state is a fork's, to be filled by `fork`: its first `shared` blocks will be its parent's, so only the
        others are taken now, with a spare order block for each shared one. With `kept` (valid: `kept_valid`)
        its first `shared` blocks are that kept prefix's, held now, before the others are taken (which could
        otherwise take them); the caller then writes the rest of the state as `share_prefix`'s callers do."""
        need = -(-tokens // self.block_size)
        if not 0 <= shared < max(need, 1):
            raise ValueError(f"a state of {need} blocks cannot share {shared}")
        if kept is not None and (shared > len(kept.blocks) or not self.kept_valid(kept)):
            raise ValueError(f"a kept prefix of {len(kept.blocks)} blocks, valid {self.kept_valid(kept)}, cannot "
                             f"give {shared}")
        if not self.fits_ever(tokens):
            if tokens > self.max_tokens:
                raise CacheFull(f"{tokens} tokens are more than the {self.max_tokens} this decode cache was built "
                                "for", never=True)
            raise CacheFull(f"{tokens} tokens need {self.bytes_for(tokens)} bytes of decode cache; its capacity "
                            f"is {self.capacity_bytes} bytes", never=True)
        if not self.fits_now(tokens, shared, kept):
            raise CacheFull(f"decode cache full: {tokens} tokens do not fit now")
        first: list[int] = kept.blocks[:shared].tolist() if kept is not None else [-1] * shared
        # a kept prefix no request holds lends its blocks' own main-order rows too: no one else reads them
        adopt = kept is not None and not self.allocator.refs[kept.blocks[:shared]].any()
        if kept is not None:
            self.allocator.hold(kept.blocks[:shared])
        blocks, orders = self.allocator.take(need - shared, 0 if adopt else shared)
        slot = self._free_slots.pop()
        self.block_table[slot, shared:need] = torch.tensor(blocks, dtype=torch.long).to(self.device)
        # the scratch block until `fork` or `share_prefix` gives the holder's
        self.block_table[slot, :shared] = (torch.from_numpy(kept.blocks[:shared]).to(self.device) if kept is not None
                                           else 0)
        self.order_table[slot, :need] = torch.tensor((first if adopt else orders) + blocks,
                                                     dtype=torch.long).to(self.device)
        return DecodeState(slot=slot, blocks=first + blocks, num_buckets=[None] * len(self.indexes),
                           index_len=[0] * len(self.indexes), shared=shared, order_blocks=orders)

    def keep_prefix(self, state: DecodeState, blocks: int) -> KeptPrefix:
        """The first `blocks` blocks of `state` (whole: at most `shared_blocks(state.length)`), about to be freed,
        kept for a later request to share (`allocate(..., kept=)`) until one of them is handed out again."""
        if state.slot < 0 or not 0 < blocks <= self.shared_blocks(state.length):
            raise ValueError(f"a state of {state.length} positions keeps 1 to {self.shared_blocks(state.length)} "
                             f"blocks; asked for {blocks}")
        first = np.asarray(state.blocks[:blocks], dtype=np.int64)
        return KeptPrefix(self.allocator.keep(first), first, state.length)

    def kept_valid(self, kept: KeptPrefix) -> bool:
        """Whether a kept prefix's blocks still hold what its request wrote (none handed out since)."""
        return self.allocator.kept_valid(kept.kept, kept.blocks)

    def kept_ids(self, blocks: list[int]) -> set[int]:
        """The kept prefixes (allocator ids) that any of `blocks` carries."""
        return set(self.allocator.kept_by[blocks].tolist()) - {0}

    def drop_kept(self, kept: list[KeptPrefix]) -> None:
        """Those kept prefixes end: their free blocks' pages can go back (`take_releasable`)."""
        self.allocator.drop_kept(k.kept for k in kept)

    def free(self, state: DecodeState) -> None:
        """Give back a state's slot, its spare order blocks and its hold on its blocks: a block shared with a fork
        or parent still running stays theirs, the others are free again."""
        if state.slot < 0:
            return
        self.allocator.release(state.blocks, state.order_blocks)
        self.hashed_ahead.pop(state.slot, None)
        self._free_slots.append(state.slot)
        state.blocks, state.slot, state.order_blocks, state.shared = [], -1, [], 0

    def refs(self, block: int) -> int:
        """How many requests hold `block` now."""
        return int(self.allocator.refs[block])

    def check_writable(self, state: DecodeState, position: int) -> None:
        """AssertionError when a step of `state` would write a block it shares with another request (`fork`: a
        fork's first `shared` blocks, or a parent's blocks a fork holds too). A step writes position
        `state.length` and, for successor-value heads, the one before: call with `position` = length - 1
        (the positions after are in later blocks, never shared)."""
        for p in (position, position + 1):
            i = p // self.block_size
            if p >= 0 and i < len(state.blocks) and (i < state.shared or self.allocator.refs[state.blocks[i]] > 1):
                raise AssertionError(f"slot {state.slot}: position {p} lies in a block shared with another request")

    def fork(self, parent: DecodeState, child: DecodeState) -> None:
        """Fill `child` (from `allocate(tokens, shared)`, length 0, `shared` at most `shared_blocks(parent.length)`)
        with `parent`'s state, as `restore_snapshot(take_snapshot(parent))` would, but sharing instead of copying
        the parent's first `child.shared` blocks of keys, values and key factors (each block's holders counted:
        `free`). The child gets copies of the rest: the block holding the parent's last position and any after
        it, its main orders (into the child's own order rows: merges rewrite them), its bucket counts and
        recent orders, its local rings, its buckets hashed ahead and its lengths. The child then steps exactly as the
        parent would (same bits: only copies), and writing never touches a shared block (`check_writable`)."""
        k, bs = child.shared, self.block_size
        if parent.slot < 0 or child.slot < 0 or child.length != 0:
            raise ValueError("a fork goes from a live state into a fresh one")
        if k > self.shared_blocks(parent.length) or child.capacity * bs < parent.length:
            raise ValueError(f"a fork of a state of {parent.length} positions shares at most "
                             f"{self.shared_blocks(parent.length)} blocks and needs room for them all; this one "
                             f"shares {k} of {child.capacity}")
        self.share_prefix(parent, child)
        own = torch.arange(k * bs, parent.length, device=self.device)  # positions in the child's own blocks
        slots = torch.tensor([parent.slot, child.slot], device=self.device)
        rows = self.rows(slots, own.view(1, -1).expand(2, -1))  # (2, n)
        ring_width = self.ring.width
        for li, index in enumerate(self.indexes):
            if index is None:
                kv = self.kv[li]
                kv[child.slot * ring_width : (child.slot + 1) * ring_width] = \
                    kv[parent.slot * ring_width : (parent.slot + 1) * ring_width]
                continue
            norms = self.norms[li]
            assert norms is not None
            self.kv[li].index_copy_(0, rows[1], self.kv[li].index_select(0, rows[0]))
            norms.index_copy_(0, rows[1], norms.index_select(0, rows[0]))
            n = parent.index_len[li]
            if n:
                at = torch.arange(n, device=self.device).view(1, -1).expand(2, -1)
                order_rows = BlockLookup(self.order_table, slots, bs).rows(at)  # (2, n)
                index.order.index_copy_(0, order_rows[1], index.order.index_select(0, order_rows[0]))
            index.main_counts[child.slot] = index.main_counts[parent.slot]
            index.recent_counts[child.slot] = index.recent_counts[parent.slot]
            index.recent[child.slot] = index.recent[parent.slot]
        plan = self.hashed_ahead.get(parent.slot)
        self.hashed_ahead.pop(child.slot, None)
        if plan is not None:  # the lists are the child's own (a bucket-count change pops them); tensors never change
            self.hashed_ahead[child.slot] = HashedAhead(plan.num_buckets,
                                                        {li: list(parts) for li, parts in plan.slices.items()})
        child.length = parent.length
        child.num_buckets = list(parent.num_buckets)
        child.index_len = list(parent.index_len)

    def share_prefix(self, holder: DecodeState, child: DecodeState) -> None:
        """Point `child`'s first `child.shared` blocks (from `allocate(tokens, shared)`, not filled yet) at
        `holder`'s, which must have written past them (at most `shared_blocks(holder.length)`), and count `child`
        among their holders (`free`). Only keys, values and key factors are shared: the caller fills the rest
        (`fork`, or a restore of the same positions' state: model/decoding/snapshot.py `restore_snapshot`)."""
        k = child.shared
        if holder.slot < 0 or child.slot < 0 or child.length != 0 or any(b >= 0 for b in child.blocks[:k]):
            raise ValueError("blocks are shared from a live state into a fresh one")
        if k > self.shared_blocks(holder.length):
            raise ValueError(f"a state of {holder.length} positions shares at most "
                             f"{self.shared_blocks(holder.length)} blocks; asked for {k}")
        child.blocks[:k] = holder.blocks[:k]
        self.allocator.hold(child.blocks[:k])
        self.block_table[child.slot, :k] = self.block_table[holder.slot, :k]

    # ---- resident pages ----------------------------------------------------------------------------------
    @property
    def written_free_bytes(self) -> int:
        """Bytes of the free blocks written since their pages were last given back (`take_releasable`): at most
        what the free part of the pools keeps resident (a block inside a huge page that a used block shares
        stays resident after its release)."""
        return len(self.allocator.written) * self.bytes_per_block

    @property
    def kept_prefix_bytes(self) -> int:
        """Bytes of the blocks that carry a kept prefix (`keep_prefix`), shared now or free: resident."""
        return self.allocator.kept_blocks() * self.bytes_per_block

    def take_releasable(self, keep_blocks: int = 0, reach: int = 1) -> list[tuple[int, int]]:
        """Row ranges [start, stop) of the block pools (`block_pools`) whose contents are dead and whose pages
        the owner gives back now (service/engine/runner.py `release_free_pages`): the block runs
        `BlockAllocator.releasable` gives (free blocks written since their pages were last given back, above the
        `keep_blocks` lowest free ones, widened by up to `reach` free blocks so that they can cover whole huge
        pages). Safe because a read never reaches a pool row not written since its block's allocation (see the
        pools in `__init__`)."""
        return [(first * self.block_size, stop * self.block_size)
                for first, stop in self.allocator.releasable(keep_blocks, reach)]
