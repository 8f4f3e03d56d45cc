#!/usr/bin/env python3
"""Print a catalog entry's shape block for localllm/modelstore/catalog_shapes.toml.

From the real file (exact; the catalog's sha256 for it is recorded):
    python -m scripts.catalog_shape NAME --file FILE.gguf
From a published config (scripts/synth_shapes.py's named shapes), a quant's base type and the
published file size (an estimate: each tensor's bytes are scaled to that size):
    python -m scripts.catalog_shape 27b-q3 --synth qwen35-27b --type Q3_K --size 14900000000 \
        --source "Qwen3.6-27B's config.json (reference: models-and-cards.md 1a)"
From another file of the same model at another quant (every quantized tensor retyped):
    python -m scripts.catalog_shape gemma3-270m:it-q8 --file base.gguf --type Q8_0 \
        --size 291545600 --source "..."
Paste the output into catalog_shapes.toml; tests/test_catalog_shape.py checks the file.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

from localllm.modelstore.catalog_shape import GENERAL_KEYS, SHAPE_KEYS, tensor_lines
from localllm.modelstore.gguf_header import GGUFHeader, TensorEntry, read_header
from localllm.modelstore.store import sha256_file

FLOAT_TYPES = {"F32", "F16", "BF16"}


def retyped(header: GGUFHeader, ggml: str) -> tuple[TensorEntry, ...]:
    """Every quantized matrix of the header in type `ggml` where its rows fit the type's
    blocks (norms, biases and float tensors stay as they are, as llama.cpp's quantizer
    leaves them)."""
    kind = GGMLQuantizationType[ggml]
    block = GGML_QUANT_SIZES[kind][0]
    return tuple(
        TensorEntry(t.name, kind, t.shape, t.offset)
        if t.ggml_type.name not in FLOAT_TYPES and t.shape[0] % block == 0 else t
        for t in header.tensors)


def synth_header(shape_name: str, ggml: str) -> GGUFHeader:
    """The header synth_gguf writes for a named shape (a sparse file: no weights on disk)."""
    from scripts import synth_gguf

    config = synth_gguf.SHAPES[shape_name]
    with tempfile.TemporaryDirectory() as d:
        path = synth_gguf.write_gguf(Path(d) / "shape.gguf", config, ggml, fill="sparse")
        return read_header(path)


def _value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, str):
        return json.dumps(v)
    return repr(v)


def shape_block(name: str, header: GGUFHeader, tensors: tuple[TensorEntry, ...], *,
                display_name: str, file_type: int | None, sha256: str = "", size: int = 0,
                source: str = "") -> str:
    md = header.metadata
    arch = md["general.architecture"]
    n_vocab = int(md.get(f"{arch}.vocab_size") or header.array_lengths.get(
        "tokenizer.ggml.tokens", 0))
    lines = [f"[{json.dumps(name)}]"]
    if sha256:
        lines += ['origin = "header"', f'sha256 = "{sha256}"', f"file_size = {header.file_size}"]
    else:
        weights = sum(t.n_bytes for t in tensors)
        lines += ['origin = "derived"', f"source = {json.dumps(source)}",
                  f"file_size = {size}", f"scale = {size / weights:.4f}"]
    lines.append(f"n_vocab = {n_vocab}")
    lines.append("tensors = [")
    lines += [f'  "{line}",' for line in tensor_lines(tensors)]
    lines.append("]")
    lines.append(f"[{json.dumps(name)}.metadata]")
    kept = {"general.architecture": arch, "general.name": display_name,
            "general.file_type": file_type if file_type is not None else md.get(
                "general.file_type")}
    kept.update({f"{arch}.{k}": md[f"{arch}.{k}"] for k in SHAPE_KEYS if f"{arch}.{k}" in md})
    lines += [f'"{k}" = {_value(v)}' for k, v in kept.items()
              if v is not None and (k in GENERAL_KEYS or k.startswith(f"{arch}."))]
    return "\n".join(lines) + "\n"


def file_type_of(quant: str | None) -> int | None:
    """The GGUF file type for a quant label (`Q4_K_M`, `UD-Q3_K_XL` -> None: no such type)."""
    if not quant:
        return None
    label = quant.upper().removeprefix("UD-")
    for prefix in ("MOSTLY_", "ALL_"):
        if prefix + label in LlamaFileType.__members__:
            return int(LlamaFileType[prefix + label])
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("name", help="the catalog entry's name")
    p.add_argument("--file", type=Path, help="a GGUF file (its header is read)")
    p.add_argument("--synth", help="a named shape of scripts/synth_shapes.py")
    p.add_argument("--type", help="the quant's base ggml type (Q3_K, Q4_K, Q8_0, ...)")
    p.add_argument("--quant", help="the quant's label, for the file type (Q4_K_M)")
    p.add_argument("--size", type=int, help="the published file size in bytes")
    p.add_argument("--source", help="where the config and size come from, in words")
    p.add_argument("--display-name", help="general.name (default: the file's, or NAME)")
    p.add_argument("--context", type=int, help="the trained context, where the published "
                   "config differs from the named shape's (Llama 3 8B: 8192)")
    args = p.parse_args(argv)
    if bool(args.file) == bool(args.synth):
        p.error("give one of --file and --synth")
    derived = bool(args.synth or args.type)
    if derived and not (args.type and args.size and args.source):
        p.error("a derived shape needs --type, --size and --source")
    header = read_header(args.file) if args.file else synth_header(args.synth, args.type)
    if args.context:
        arch = header.metadata["general.architecture"]
        header.metadata[f"{arch}.context_length"] = args.context
    # A synthetic header is written at --type already (gpt-oss keeps its MXFP4 experts).
    tensors = retyped(header, args.type) if args.type and args.file else header.tensors
    name = args.display_name or (args.name if args.synth else
                                 header.metadata.get("general.name", args.name))
    file_type = file_type_of(args.quant or args.type) if derived else None
    sys.stdout.write(shape_block(
        args.name, header, tensors, display_name=name, file_type=file_type,
        sha256="" if derived else sha256_file(args.file), size=args.size or 0,
        source=args.source or ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
