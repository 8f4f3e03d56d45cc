"""A filled context without prefilling it: a llama.cpp sequence-state file of N cells of zeros.

Decode at depth costs what the KV cache it reads costs, not what the cache holds, so a
benchmark can measure decode after half the context without processing a 64K-token prompt
(with whole blocks on the CPU, llama.cpp's own prefill of that prompt takes hours of CPU
attention). The file is what `llama_state_seq_save_file` writes (state version 3, the llama.cpp
that llama-cpp-python 0.3.36 vendors), for one sequence of a plain KV cache (full attention,
one stream, V not transposed: flash attention on):

    u32 magic 'ggsq', u32 version, u32 n_tokens, i32 tokens[n_tokens],
    u32 n_stream = 1, u32 cell_count,
    cell_count x (i32 pos, u32 n_seq_id = 1, i32 seq_id = 0),
    u32 v_trans = 0, u32 n_layer,
    n_layer x (i32 k_type, u64 k_row_bytes, cell_count rows),
    n_layer x (i32 v_type, u64 v_row_bytes, cell_count rows)

The rows are holes in a sparse file: zeros, read at memory speed. llama.cpp restores it with
`llama_state_seq_load_file` (ours) or llama-server's `POST /slots/0?action=restore` (fit).
"""

from __future__ import annotations

import struct
from pathlib import Path

from localllm.modelstore.shape import RECURRENT_LAYER, SLIDING, ModelShape
from localllm.engine.params import GGML_TYPES
from localllm.planner.memory import kv_row_bytes

MAGIC = 0x67677371  # 'ggsq'
VERSION = 3
FILL_TOKEN = 1000


def fillable(shape: ModelShape) -> bool:
    """Only plain full-attention caches have the one-cache layout written here."""
    return all(layer.kind not in (SLIDING, RECURRENT_LAYER) for layer in shape.layers
               if not layer.is_nextn)


def write_fill(path: Path, shape: ModelShape, n_cells: int, type_k: str, type_v: str,
               token: int = FILL_TOKEN) -> list[int]:
    """Write the state file; returns the tokens it claims (the prompt prefix that reuses it)."""
    layers = [layer for layer in shape.layers if not layer.is_nextn]
    tokens = [token] * n_cells
    with open(path, "wb") as f:
        f.write(struct.pack("<III", MAGIC, VERSION, n_cells))
        f.write(struct.pack(f"<{n_cells}i", *tokens))
        f.write(struct.pack("<II", 1, n_cells))
        cell = struct.Struct("<iIi")
        f.write(b"".join(cell.pack(pos, 1, 0) for pos in range(n_cells)))
        f.write(struct.pack("<II", 0, len(layers)))
        for kind, elements in (("k", "head_dim_k"), ("v", "head_dim_v")):
            ggml_type = type_k if kind == "k" else type_v
            for layer in layers:
                row = kv_row_bytes(ggml_type, layer.n_head_kv * getattr(layer, elements))
                f.write(struct.pack("<iQ", GGML_TYPES[ggml_type], row))
                f.seek(row * n_cells, 1)  # a hole: zeros
        f.truncate(f.tell())
    return tokens
