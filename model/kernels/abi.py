"""The one Python definition of the C kernels' interface (csrc/step_kernels.h): the exported functions'
prototypes, the columns of a decode step's row facts (`meta`), the step's layer and embedding structs and the
status codes. tests/model/kernels/test_abi.py parses the C sources and fails on any difference, so a change on
one side that the other does not make fails a test instead of reading the wrong word."""

from __future__ import annotations

import ctypes
from enum import IntEnum
from typing import Any


class Meta(IntEnum):
    """A decode step's facts of one row, one int64 each: meta (B, META_COLUMNS), built by
    model/decoding/facts.py `row_facts`, read by the PyTorch step and by the C kernels (META_* in the header)."""

    SLOT = 0  # the row's request slot
    POSITION = 1  # the new position
    HASHED = 2  # 1 when its LSH layers hash (its padded length is past one chunk)
    LSH_CHUNKS = 3  # chunks of its padded length, at the LSH chunk size (at least 1)
    LOCAL_DENSE = 4  # 1 while its local layers attend every position (padded length within one chunk)
    INDEX_SLOT = 5  # the slot whose LSH index it appends to (the scratch slot when it keeps none)
    KEEPS_INDEX = 6  # 1 when it keeps an LSH index


META_COLUMNS = len(Meta)

# kernel statuses (bit flags)
NO_MEMORY, BAD_INDEX, BAD_KIND = 1, 2, 4

# the element kinds of key and value pools the kernels read (window_kinds() says which a build has)
KIND_FLOAT32, KIND_FLOAT16, KIND_BFLOAT16 = 0, 1, 2
MAX_ROUNDS = 64  # the C side's bound on hash rounds
KEY_NORM_EPS = 1e-6  # the epsilon of an LSH key's length factor (model/attention.py's, the same value)
PANEL = 32  # step_linear.c's columns per packed panel
# how a decode step's linear weights are packed (WEIGHTS_* in the header; step_linear_q.c)
WEIGHTS = {"float32": 0, "bfloat16": 1, "int8": 2}

# chunk_attend's rules for which keys a query may see: LSH attention (its own position only when nothing else
# is allowed: the caller rebuilds those rows), causal or not; local attention, causal or not
CHUNK_RULES = {"other": 0, "earlier": 1, "up_to": 2, "any": 3}

_I64, _PTR, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class StepLayer(ctypes.Structure):
    """One layer of a fused decode step (decode_layers): every field one 8-byte word."""

    _fields_ = [
        ("lsh", _I64), ("heads", _I64), ("dim", _I64), ("kind", _I64), ("pool_rows", _I64), ("stride", _I64),
        ("ring", _I64),
        ("ln_w", _PTR), ("ln_b", _PTR), ("proj_w", _PTR), ("proj_b", _PTR), ("keys", _PTR), ("values", _PTR),
        ("norms", _PTR), ("rounds", _I64), ("buckets", _I64), ("recent_size", _I64), ("items_len", _I64),
        ("item_bytes", _I64), ("shift", _I64), ("recent_offset", _I64), ("main_counts", _PTR),
        ("recent_counts", _PTR), ("items", _PTR), ("chunk", _I64), ("before", _I64), ("after", _I64),
        ("successor", _I64), ("ff", _I64),
        ("act", _I64), ("w_out", _PTR), ("b_out", _PTR), ("ff_ln_w", _PTR), ("ff_ln_b", _PTR), ("w_dense", _PTR),
        ("b_dense", _PTR), ("w_ff", _PTR), ("b_ff", _PTR), ("order_table", _PTR),
    ]


class StepEmbedding(ctypes.Structure):
    """The token and position embeddings of a fused decode step: a token's row of `word` plus its position's row
    of `pos0` (plain table: pos1 NULL), or axial [pos0[t / s1], pos1[t % s1]] of d0 and d1 columns."""

    _fields_ = [("word", _PTR), ("word_rows", _I64), ("pos0", _PTR), ("pos0_rows", _I64), ("d0", _I64),
                ("pos1", _PTR), ("s1", _I64), ("d1", _I64)]


# each exported function: its C return type and its parameters, one letter each: I int64_t, F float, P pointer
PROTOTYPES: dict[str, tuple[str, str]] = {
    "window_attend": ("int", "IIIIIIPPPPIIPPIIPPPFFPI"),
    "lsh_attend": ("int", "IIIIIIIIIIPPPPIIPPPPPIIIIPPIIIFFIPI"),
    "chunk_attend": ("int", "IIIIIIPPPPPPPPPPPPIFPPPPI"),
    "lsh_merge_blocks": ("int", "IIIIIPIIPIPPP"),
    "decode_write": ("int", "IIIIIIPPPPPPFFIP"),
    "lsh_append": ("int", "IIIIIPPPPIII"),
    "step_linear": ("int", "IIIPIPPP"),
    "step_linear_w": ("int", "IIIIPIPPP"),
    "lsh_hash": ("int", "IIIIIIPPPP"),
    "lsh_buckets": ("void", "IIIIPPP"),
    "lsh_order": ("int", "IIIPP"),
    "step_tail": ("int", "IIIIPPPPPPPFPPIPPI"),
    "decode_layers": ("int", "IIIPPIPPPPPPPPIIIIPPFPPIPII"),
    "extend_layers": ("int", "IIIPPPPPPPPPPIIIIPPFPPIPIII"),
    "layer_norm_rows": ("void", "IIPPPFP"),
    "step_layer_words": ("int64_t", ""),
    "step_embedding_words": ("int64_t", ""),
    "step_linear_pack": ("void", "IIPP"),
    "window_kinds": ("int64_t", ""),
}

_TYPES = {"I": _I64, "F": _F32, "P": _PTR}
_RETURNS = {"int": ctypes.c_int, "int64_t": _I64, "void": None}


def declare(lib: ctypes.CDLL) -> dict[str, Any]:
    """Every function of PROTOTYPES in `lib`, its argument and return types set from the table."""
    out = {}
    for name, (returns, params) in PROTOTYPES.items():
        fn = getattr(lib, name)
        fn.argtypes = [_TYPES[c] for c in params]
        fn.restype = _RETURNS[returns]
        out[name] = fn
    return out
