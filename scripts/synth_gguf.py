#!/usr/bin/env python3
"""Write synthetic GGUF models with the exact tensor table of a named shape.

Speed and memory of llama.cpp do not depend on weight values, so a synthetic file measures what
the real model costs without downloading it, with one exception: which experts an MoE model
routes to (scripts/synth_routing.py, docs/synthetic-routing.md). Fillings:
  sparse  header plus holes: no disk used, llama.cpp reads zeros (planning, dry runs, loads;
          an MoE model then routes every token to the same experts)
  random  small random weights, quantized validly, so the model computes finite numbers (16
          rows tiled per matrix; an MoE model draws its dense matrices in full and tiles its
          expert tensors by whole experts, so that routing follows the routers)
  noise   every weight drawn (tiny shapes)
  zeros   written zeros (a sparse file on a filesystem without holes)
--routing (MoE shapes) uniform, balanced, zipf:S, local:G,S or real (scripts/synth_routing.py).

    python -m scripts.synth_gguf dense-27b /tmp/dense-27b.gguf --type Q4_0 --fill random
    python -m scripts.synth_gguf --list
    python -m scripts.synth_gguf llama-8b /tmp/tiny.gguf --tiny      # a loadable toy of that shape
    python -m scripts.synth_gguf qwen3-next-80b-a3b /tmp/80b.gguf --fill random --routing zipf:0.6

The vocabulary is a byte-fallback SentencePiece one ("llama" tokenizer) of the shape's size.
The shapes and their tensor tables: scripts/synth_shapes.py. A vision pair (a Gemma 3 model
and its projector): scripts/synth_vision.py.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from scripts import synth_routing
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, LlamaFileType
from gguf import quants as gguf_quants
# The shapes, which the benchmarks and tests also import from here.
from scripts.synth_shapes import (  # noqa: F401
    SHAPES, ShapeConfig, Tensor, fewer_experts, tensor_table, tiny,
)

# ---- each tensor's type in the file ----------------------------------------------------------

def tensor_type(name: str, dims: tuple[int, ...], qtype: GGMLQuantizationType,
                arch: str = "") -> GGMLQuantizationType:
    """Matrices take the chosen type where their rows fit its blocks; vectors, biases,
    convolutions, the MoE router and rows that do not fit stay float, as llama.cpp's quantizer
    leaves them. gpt-oss's experts are MXFP4 whatever the rest is, as published."""
    if (len(dims) < 2 or name.endswith(("ssm_conv1d.weight", ".bias"))
            or name.endswith("ffn_gate_inp.weight")):
        return GGMLQuantizationType.F32
    if arch == "gpt-oss" and "_exps." in name:
        qtype = GGMLQuantizationType.MXFP4
    block = GGML_QUANT_SIZES[qtype][0]
    if dims[0] % block:
        return GGMLQuantizationType.F16
    return qtype


def tensor_bytes(dims: tuple[int, ...], ggml_type: GGMLQuantizationType) -> int:
    block, size = GGML_QUANT_SIZES[ggml_type]
    n = 1
    for d in dims:
        n *= d
    return n // block * size


# ---- metadata ---------------------------------------------------------------------------------

_FILE_TYPES = {"F32": LlamaFileType.ALL_F32, "F16": LlamaFileType.MOSTLY_F16,
               "Q4_0": LlamaFileType.MOSTLY_Q4_0, "Q4_1": LlamaFileType.MOSTLY_Q4_1,
               "Q5_0": LlamaFileType.MOSTLY_Q5_0, "Q5_1": LlamaFileType.MOSTLY_Q5_1,
               "Q8_0": LlamaFileType.MOSTLY_Q8_0, "Q2_K": LlamaFileType.MOSTLY_Q2_K,
               "Q3_K": LlamaFileType.MOSTLY_Q3_K_M, "Q4_K": LlamaFileType.MOSTLY_Q4_K_M,
               "Q5_K": LlamaFileType.MOSTLY_Q5_K_M, "Q6_K": LlamaFileType.MOSTLY_Q6_K,
               "BF16": LlamaFileType.MOSTLY_BF16}


def _add_metadata(w: GGUFWriter, c: ShapeConfig, qtype: GGMLQuantizationType,
                  specials: tuple[str, ...] = (), chat_template: str | None = None,
                  words: tuple[str, ...] = ()) -> None:
    w.add_name(f"synthetic {c.name}")
    w.add_file_type(int(_FILE_TYPES.get(qtype.name, LlamaFileType.GUESSED)))
    w.add_context_length(c.context_length)
    w.add_embedding_length(c.n_embd)
    w.add_block_count(c.n_layer + c.n_nextn)
    if c.n_ff:
        w.add_feed_forward_length(c.n_ff)
    w.add_head_count(c.n_head)
    w.add_head_count_kv(c.n_head_kv)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(c.rope_base)
    w.add_rope_dimension_count(c.rope_dims or c.head_dim)
    w.add_vocab_size(c.n_vocab)
    if c.n_nextn:
        w.add_nextn_predict_layers(c.n_nextn)
    if c.sliding_window:
        w.add_sliding_window(c.sliding_window)
    if c.n_expert:
        w.add_expert_count(c.n_expert)
        w.add_expert_used_count(c.n_expert_used)
        w.add_expert_feed_forward_length(c.n_ff_expert)
    if c.n_ff_shexp:
        w.add_expert_shared_feed_forward_length(c.n_ff_shexp)
    if c.full_attention_interval:
        w.add_full_attention_interval(c.full_attention_interval)
    if c.arch == "qwen35moe":
        # The converter writes Qwen3.5's layer_types as one flag per block (NextN: attention).
        w.add_array(f"{c.arch}.attention.recurrent_layers",
                    [(i + 1) % c.full_attention_interval != 0 if i < c.n_layer else False
                     for i in range(c.n_layer + c.n_nextn)])
    if c.arch in ("qwen35", "qwen35moe"):
        # M-RoPE sections split the rotated half-dimensions (Qwen3.5: 64 -> 11 + 11 + 10)
        half = (c.rope_dims or c.head_dim) // 2
        w.add_rope_dimension_sections([half - 2 * (half // 3), half // 3, half // 3, 0])
    if c.ssm:
        s = c.ssm
        w.add_ssm_conv_kernel(s["d_conv"])
        w.add_ssm_state_size(s["d_state"])
        w.add_ssm_group_count(s["n_group"])
        w.add_ssm_time_step_rank(s["dt_rank"])
        w.add_ssm_inner_size(s["d_state"] * s["dt_rank"])
    _add_vocab(w, c.n_vocab, specials, words)
    if chat_template:
        w.add_chat_template(chat_template)


def _add_vocab(w: GGUFWriter, n_vocab: int, specials: tuple[str, ...] = (),
               words: tuple[str, ...] = ()) -> None:
    """A SentencePiece-style vocabulary: unk/bos/eos, any named control tokens, the 256 byte
    tokens (so any text tokenizes), printable characters, every prefix of each of `words`
    (a word then reads as one token, as a real vocabulary reads common words: SentencePiece
    merges a pair only into a piece the vocabulary has), then filler pieces up to the shape's
    vocabulary size."""
    tokens: list[bytes] = [b"<unk>", b"<s>", b"</s>"] + [t.encode() for t in specials]
    types = [2, 3, 3] + [3] * len(specials)  # unknown, control, control
    tokens += [f"<0x{i:02X}>".encode() for i in range(256)]
    types += [6] * 256  # byte
    for ch in "\u2581abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?":
        if len(tokens) < n_vocab:
            tokens.append(ch.encode())
            types.append(1)
    known = set(tokens)
    for word in words:
        for end in range(2, len(word) + 2):
            for piece in (("\u2581" + word)[:end].encode(), word[:end].encode()):
                if piece not in known and len(tokens) < n_vocab:
                    known.add(piece)
                    tokens.append(piece)
                    types.append(1)
    tokens += [f"\u2581t{i}".encode() for i in range(n_vocab - len(tokens))]
    types += [1] * (n_vocab - len(types))
    tokens, types = tokens[:n_vocab], types[:n_vocab]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([-float(i) for i in range(n_vocab)])
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)


# ---- weights ----------------------------------------------------------------------------------

def _random_row_block(ne0: int, ggml_type: GGMLQuantizationType, rng) -> bytes:
    """Valid bytes of 16 rows of small random weights, tiled to fill a tensor of that row size.

    Quantizing every weight would take minutes for a 27B model; repeating a valid block gives
    finite outputs at disk speed. Types the gguf package cannot quantize fall back to zeros."""
    rows = rng.standard_normal((16, ne0), dtype=np.float32) * 0.02
    return _encode(rows, ggml_type)


def _noise(name: str, dims: tuple[int, ...], ggml_type: GGMLQuantizationType, rng,
           scale: float = 1.0) -> bytes:
    """Every weight of one tensor drawn at random, scaled so that activations neither vanish
    nor explode through the blocks: matrices ~ N(0, scale^2/fan_in), norms near one, the
    recurrent decay (ssm_a, stored negated as llama.cpp expects) near -1; the output matrix
    larger."""
    if len(dims) == 1:
        center = -1.0 if name.endswith("ssm_a") else 0.0 if name.endswith("bias") else 1.0
        return (center + 0.1 * rng.standard_normal(dims[0])).astype(np.float32).tobytes()
    rows = rng.standard_normal((_rows(dims), dims[0]), dtype=np.float32)
    rows *= scale / np.sqrt(dims[0])
    if name == "output.weight":  # sharp logits: greedy picks seldom hang on a near-tie
        rows *= 8.0
    return _encode(rows, ggml_type)


def _encode(rows: np.ndarray, ggml_type: GGMLQuantizationType) -> bytes:
    rows = rows.astype(np.float32, copy=False)
    if ggml_type == GGMLQuantizationType.F32:
        return rows.tobytes()
    if ggml_type == GGMLQuantizationType.F16:
        return rows.astype(np.float16).tobytes()
    try:
        return gguf_quants.quantize(rows, ggml_type).tobytes()
    except (NotImplementedError, gguf_quants.QuantError):
        return bytes(tensor_bytes((rows.shape[1], rows.shape[0]), ggml_type))


def write_gguf(path: str | Path, config: ShapeConfig, qtype: str = "Q4_0",
               fill: str = "sparse", seed: int = 0, split: tuple[int, int] | None = None,
               specials: tuple[str, ...] = (), chat_template: str | None = None,
               routing: str = "uniform", words: tuple[str, ...] = ()) -> Path:
    """Write the model; return its path. `fill` is sparse, random, noise or zeros: random tiles
    a few random rows (disk speed, for big shapes), noise draws every weight (tiny shapes: a
    model whose logits differ from token to token, for tests of exact greedy output).
    `split=(i, n)` writes part i (0-based) of n of a split GGUF as llama-gguf-split lays it
    out: the tensors shared out in order, the metadata in part 0 only, split.* keys in every
    part."""
    if fill not in ("sparse", "random", "noise", "zeros"):
        raise ValueError(f"fill must be sparse, random, noise or zeros, not {fill!r}")
    synth_routing.parse(routing)
    try:
        quant = GGMLQuantizationType[qtype.upper()]
    except KeyError:
        raise ValueError(f"unknown ggml type {qtype!r}") from None
    path = Path(path)
    table = [(name, dims, tensor_type(name, dims, quant, config.arch))
             for name, dims in tensor_table(config)]
    w = GGUFWriter(path, config.arch)
    if split is None or split[0] == 0:
        _add_metadata(w, config, quant, specials, chat_template, words)
    if split is not None:
        index, count = split
        per_part = -(-len(table) // count)
        w.add_uint16("split.no", index)
        w.add_uint16("split.count", count)
        w.add_int32("split.tensors.count", len(table))
        table = table[index * per_part:(index + 1) * per_part]
    if fill == "random" and config.n_expert:
        # Tiled rows give every matrix a period of 16 in its outputs: the hidden states of a
        # few dozen tokens, and routing by accident (an LRU of 64 of 256 experts hit 80%
        # with routers drawn uniformly). MoE models draw their dense matrices in full and
        # tile each expert tensor with one drawn expert: the routing is the routers'.
        fill = "moe-random"
    write_table(w, path, table, fill, seed, synth_routing.writer(routing, config, fill, seed),
                 synth_routing.branch_scale(routing, config))
    return path


def write_table(w: GGUFWriter, path: Path, table: list[tuple[str, tuple[int, ...],
                 GGMLQuantizationType]], fill: str, seed: int, special=None,
                 scale_of=lambda name: 1.0) -> None:
    """Write the header, metadata already added to `w`, the tensor infos and the data.
    `special(name, dims, type)` may give a tensor's bytes (routing decides those);
    `scale_of(name)` scales a drawn matrix (routing shrinks the residual branches)."""
    for name, dims, ggml_type in table:
        nbytes = tensor_bytes(dims, ggml_type)
        # The writer takes numpy order (last ggml dim first) and, for raw types, the byte shape.
        byte_shape = tuple(reversed(dims[1:])) + (nbytes // max(1, _rows(dims)),)
        w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=ggml_type)
    w.write_header_to_file(path)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    f = w.fout[0]
    align = w.data_alignment
    data_start = GGUFWriter.ggml_pad(f.tell(), align)
    total = sum(GGUFWriter.ggml_pad(tensor_bytes(d, t), align) for _, d, t in table)
    if fill == "sparse":
        f.truncate(data_start + total)
    else:
        rng = np.random.default_rng(seed)
        blocks: dict[tuple[int, GGMLQuantizationType], bytes] = {}
        f.write(bytes(data_start - f.tell()))
        for _name, dims, ggml_type in table:
            nbytes = tensor_bytes(dims, ggml_type)
            data = special(_name, dims, ggml_type) if special else None
            if data is not None:  # written in full whatever the fill: routing depends on it
                f.write(data)
            elif fill == "zeros":
                _write_repeated(f, b"\0" * (1 << 20), nbytes)
            elif fill == "noise" or (fill == "moe-random" and len(dims) < 3):
                for rows in range(0, max(1, _rows(dims)), 8192):  # a 248K vocabulary is 2 GB
                    part = dims if len(dims) == 1 else (dims[0], min(8192, _rows(dims) - rows))
                    f.write(_noise(_name, part, ggml_type, rng, scale_of(_name)))
            elif fill == "moe-random":  # one expert drawn, repeated over the others
                _write_repeated(f, _noise(_name, dims[:2], ggml_type, rng, scale_of(_name)),
                                nbytes)
            else:
                key = (dims[0], ggml_type)
                if key not in blocks:
                    blocks[key] = _random_row_block(dims[0], ggml_type, rng)
                _write_repeated(f, blocks[key], nbytes)
            f.write(bytes(GGUFWriter.ggml_pad(nbytes, align) - nbytes))
    w.close()


def ensure_model(directory: str | Path, config: ShapeConfig, qtype: str = "Q4_0",
                 routing: str = "uniform", words: tuple[str, ...] = (),
                 vocab_tag: str = "") -> Path:
    """`directory`/NAME-q4_0.gguf (NAME-q4_0-zipf0.8.gguf, NAME-q4_0-local2_0_1.gguf) with random
    weights, written unless it is there (benchmarks on the GPU machine share one copy per
    shape). `words` (named by `vocab_tag` in the file name) go into the vocabulary whole."""
    synth_routing.parse(routing)  # a bad spec fails before anything is written
    tag = "" if routing == "uniform" else "-" + routing.replace(":", "").replace(",", "_")
    tag += f"-{vocab_tag}" if vocab_tag else ""
    path = Path(directory) / f"{config.name}-{qtype.lower()}{tag}.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        tmp = path.with_suffix(".tmp")  # a run killed mid-write leaves no half model behind
        write_gguf(tmp, config, qtype, "random", routing=routing, words=words)
        tmp.replace(path)
        print(f"wrote {path} in {time.monotonic() - started:.0f} s", flush=True)
    return path


def ensure_headers(directory: str | Path, qtype: str = "Q4_0") -> dict[str, Path]:
    """Sparse files of every named shape in `directory`, written once (tests share them)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, config in SHAPES.items():
        path = directory / f"{name}-{qtype.lower()}.gguf"
        if not path.exists():
            tmp = path.with_suffix(".tmp")
            write_gguf(tmp, config, qtype, "sparse")
            tmp.replace(path)
        out[name] = path
    return out


def _rows(dims: tuple[int, ...]) -> int:
    n = 1
    for d in dims[1:]:
        n *= d
    return n


def _write_repeated(f, block: bytes, nbytes: int) -> None:
    chunk = block * max(1, (8 << 20) // len(block))
    while nbytes > 0:
        piece = chunk[:min(nbytes, len(chunk))]
        f.write(piece)
        nbytes -= len(piece)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("shape", nargs="?", help=f"one of: {', '.join(SHAPES)}")
    p.add_argument("out", nargs="?", help="the .gguf file to write")
    p.add_argument("--type", default="Q4_0",
                   help="ggml type of the matrices (Q4_0, Q8_0, Q4_K, F16...)")
    p.add_argument("--fill", default="sparse", choices=("sparse", "random", "noise", "zeros"))
    p.add_argument("--tiny", action="store_true", help="toy dimensions of the same architecture")
    p.add_argument("--routing", default="uniform",
                   help="MoE routers: uniform, balanced (no reuse beyond chance), zipf:S "
                        "(Zipf-like popularity of exponent about S), local:G,S (popularity plus "
                        "locality of gain G that follows the text) or real "
                        "(docs/synthetic-routing.md)")
    p.add_argument("--list", action="store_true", help="list the shapes")
    args = p.parse_args(argv)
    if args.list or not args.shape:
        for name, c in SHAPES.items():
            print(f"{name:19} {c.arch:9} {c.n_layer + c.n_nextn} blocks, ctx {c.context_length}")
        return 0
    if args.shape not in SHAPES:
        print(f"Error: unknown shape {args.shape!r}; known: {', '.join(SHAPES)}", file=sys.stderr)
        return 1
    if not args.out:
        print("Error: give the output file", file=sys.stderr)
        return 1
    config = tiny(SHAPES[args.shape]) if args.tiny else SHAPES[args.shape]
    try:
        path = write_gguf(args.out, config, args.type, args.fill, routing=args.routing)
    except (ValueError, OSError) as e:
        print(f"Error: {e}", file=sys.stderr)
        return 1
    print(f"{path}: {path.stat().st_size / (1 << 30):.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
