#!/usr/bin/env python3
"""Write a synthetic Gemma 3 vision pair: a language model (scripts/synth_gguf.py) and a Gemma 3
projector (SigLIP encoder, average pool, soft-embedding norm, input projection) with the tensor
names and keys the vendored mtmd reads.

    python -m scripts.synth_vision /tmp/vl                      # model.gguf + mmproj.gguf, toy
    python -m scripts.synth_vision /tmp/vl27 --shape gemma3-27b # the full-size pair
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from scripts import synth_gguf
from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType
from scripts.synth_gguf import SHAPES, ShapeConfig, tiny, write_gguf

@dataclass(frozen=True)
class ProjectorConfig:
    """A Gemma 3 projector: a SigLIP vision tower, then average pooling by `n_merge` per side,
    an RMS norm and the projection into the language model's embedding (clip.cpp's
    PROJECTOR_TYPE_GEMMA3, built by tools/mtmd/models/siglip.cpp)."""

    name: str
    image_size: int
    patch_size: int
    n_embd: int
    n_ff: int
    n_layer: int
    n_head: int
    n_merge: int  # pooling kernel per side: (image_size / patch_size / n_merge)^2 image tokens
    n_embd_text: int

    @property
    def image_tokens(self) -> int:
        return (self.image_size // self.patch_size // self.n_merge) ** 2


# Gemma 3 4B-27B's SigLIP-So400m at 896 px: 27 blocks of 1152, 256 tokens per image.
PROJECTORS: dict[str, ProjectorConfig] = {
    "gemma3-27b": ProjectorConfig("gemma3-27b", image_size=896, patch_size=14, n_embd=1152,
                                  n_ff=4304, n_layer=27, n_head=16, n_merge=4,
                                  n_embd_text=5376),
}

# The markers mtmd wraps a Gemma 3 image in, and the turn markers of the chat template below:
# control tokens of the vocabulary, as in Gemma 3's own.
VISION_SPECIALS = ("<start_of_image>", "<end_of_image>", "<start_of_turn>", "<end_of_turn>")
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}")


def tiny_projector(text: ShapeConfig) -> ProjectorConfig:
    """A toy tower: 224 px in 14 px patches, 2 blocks of 64, pooled 2x2 to 64 image tokens."""
    return ProjectorConfig(f"{text.name}-tiny", image_size=224, patch_size=14, n_embd=64,
                           n_ff=128, n_layer=2, n_head=4, n_merge=2, n_embd_text=text.n_embd)


def projector_table(p: ProjectorConfig) -> list[tuple[str, tuple[int, ...],
                                                       GGMLQuantizationType]]:
    """The tensors clip.cpp loads for a Gemma 3 projector, ggml dims (ne0 first), with the types
    of a published mmproj-f16: matrices and the patch kernel F16, vectors and positions F32."""
    E, F, P = p.n_embd, p.n_ff, p.patch_size
    n_patches = (p.image_size // P) ** 2
    f16, f32 = GGMLQuantizationType.F16, GGMLQuantizationType.F32
    out = [("v.patch_embd.weight", (P, P, 3, E), f16), ("v.patch_embd.bias", (E,), f32),
           ("v.position_embd.weight", (E, n_patches), f32)]
    for i in range(p.n_layer):
        b = f"v.blk.{i}"
        for proj in ("attn_q", "attn_k", "attn_v", "attn_out"):
            out += [(f"{b}.{proj}.weight", (E, E), f16), (f"{b}.{proj}.bias", (E,), f32)]
        out += [(f"{b}.ln1.weight", (E,), f32), (f"{b}.ln1.bias", (E,), f32),
                (f"{b}.ln2.weight", (E,), f32), (f"{b}.ln2.bias", (E,), f32),
                (f"{b}.ffn_up.weight", (E, F), f16), (f"{b}.ffn_up.bias", (F,), f32),
                (f"{b}.ffn_down.weight", (F, E), f16), (f"{b}.ffn_down.bias", (E,), f32)]
    out += [("v.post_ln.weight", (E,), f32), ("v.post_ln.bias", (E,), f32),
            ("mm.soft_emb_norm.weight", (E,), f32),
            # ggml_mul_mat(transpose(W), x): W's ne0 is the text embedding
            ("mm.input_projection.weight", (p.n_embd_text, E), f16)]
    return out


def write_projector(path: str | Path, p: ProjectorConfig, fill: str = "noise",
                    seed: int = 1) -> Path:
    """Write the projector GGUF (general.architecture "clip", the clip.* keys of a Gemma 3
    mmproj). `noise` draws every weight, `random` tiles a few rows (full size, disk speed)."""
    path = Path(path)
    w = GGUFWriter(path, "clip")
    w.add_name(f"synthetic {p.name} projector")
    w.add_file_type(int(LlamaFileType.MOSTLY_F16))
    w.add_string("clip.projector_type", "gemma3")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_bool("clip.use_gelu", True)
    w.add_uint32("clip.vision.image_size", p.image_size)
    w.add_uint32("clip.vision.patch_size", p.patch_size)
    w.add_uint32("clip.vision.embedding_length", p.n_embd)
    w.add_uint32("clip.vision.feed_forward_length", p.n_ff)
    w.add_uint32("clip.vision.block_count", p.n_layer)
    w.add_uint32("clip.vision.projection_dim", p.n_embd_text)
    w.add_uint32("clip.vision.attention.head_count", p.n_head)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    w.add_uint32("clip.vision.projector.scale_factor", p.n_merge)
    synth_gguf.write_table(w, path, projector_table(p), fill, seed)
    return path


def write_vision_pair(out_dir: str | Path, shape: str | None = None,
                      qtype: str = "Q4_0") -> tuple[Path, Path]:
    """OUT_DIR/model.gguf and OUT_DIR/mmproj.gguf: without `shape` a toy pair for tests (every
    weight drawn, a few MB), with one (gemma3-27b) the full-size pair, weights tiled."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if shape is None:
        # Untied output (which llama.cpp's gemma3 takes when present): with random weights a
        # tied one makes the model repeat its last input token, whatever came before it.
        text = replace(tiny(SHAPES["gemma3-27b"]), tied_embeddings=False)
        proj, fill, qtype = tiny_projector(text), "noise", "Q8_0"
    else:
        if shape not in PROJECTORS:
            raise ValueError(f"no projector for shape {shape!r}; known: {', '.join(PROJECTORS)}")
        text, proj, fill = SHAPES[shape], PROJECTORS[shape], "random"
    model = write_gguf(out_dir / "model.gguf", text, qtype, fill, specials=VISION_SPECIALS,
                       chat_template=GEMMA_TEMPLATE)
    mmproj = write_projector(out_dir / "mmproj.gguf", proj, fill)
    return model, mmproj


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", help="writes OUT_DIR/model.gguf and OUT_DIR/mmproj.gguf")
    p.add_argument("--shape", help=f"the full-size pair of {', '.join(PROJECTORS)}")
    p.add_argument("--type", default="Q4_0", help="ggml type of the language model's matrices")
    args = p.parse_args(argv)
    try:
        paths = write_vision_pair(args.out_dir, args.shape, args.type)
    except (ValueError, OSError) as e:
        print(f"Error: {e}", file=sys.stderr)
        return 1
    for path in paths:
        print(f"{path}: {path.stat().st_size / (1 << 20):.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
