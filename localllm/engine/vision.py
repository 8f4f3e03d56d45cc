"""Images in the runner: the model's projector (mmproj) through mtmd, llama.cpp's multimodal
library that llama-cpp-python ships (`llama_cpp.mtmd_cpp`, libmtmd).

A prompt with images is text with one media marker per image. `Vision.tokenize` turns it into
one token list the engine can schedule like any other: text tokens as they are, and each image
as `n_tokens` copies of a negative placeholder derived from the image's content hash. The
engine's prefix reuse compares those lists, so the same image at the same place keeps its KV
cells and a different image is read again. When the engine reaches a placeholder it calls
`read_image`, which encodes that one image with the projector and decodes its embeddings into
the slot's sequence (between two decode steps: a cancel waits at most one image).

Runs inside the runner process only.
"""

from __future__ import annotations

import base64
import binascii
import ctypes
import hashlib
import logging
import os
from dataclasses import dataclass, field

import llama_cpp

from .model import RequestError

log = logging.getLogger("localllm.runner")

class _LazyMtmd:
    """llama-cpp-python's mtmd binding, loaded on first use: importing it loads libmtmd, which
    a text model never needs (and a build may lack). With LLAMA_CPP_LIB_PATH (a build of one's
    own, CUDA say) libmtmd comes from the same folder, as libllama does."""

    def __getattr__(self, name: str):
        if os.environ.get("LLAMA_CPP_LIB_PATH") and not os.environ.get("MTMD_CPP_LIB"):
            os.environ["MTMD_CPP_LIB"] = os.environ["LLAMA_CPP_LIB_PATH"]
        from llama_cpp import mtmd_cpp

        return getattr(mtmd_cpp, name)


mtmd = _LazyMtmd()

# ggml_log_level: mtmd logs the whole text of each prompt it tokenizes at DEBUG, and its own
# default logger prints every level to stderr (runner.log). Info and above only.
_LOG_INFO, _LOG_CONT = 2, 5
_last_level = _LOG_INFO


@llama_cpp.llama_log_callback
def _mtmd_log(level: int, text: bytes, _user_data) -> None:
    global _last_level
    if level != _LOG_CONT:  # a continuation belongs to the line before it
        _last_level = level
    if _last_level >= _LOG_INFO and text:
        os.write(2, text)


def _quiet_mtmd_debug() -> None:
    mtmd.mtmd_log_set(_mtmd_log, ctypes.c_void_p())
    mtmd.mtmd_helper_log_set(_mtmd_log, ctypes.c_void_p())
_CHUNK_TEXT = 0  # mtmd_input_chunk_type
_PLACEHOLDER_SPAN = 1 << 62


def placeholder(digest: bytes) -> int:
    """The negative stand-in token of one image, from its content hash (never a vocab id)."""
    return -1 - int.from_bytes(digest[:8], "big") % _PLACEHOLDER_SPAN


def is_image_token(token: int) -> bool:
    return token < 0


def text_tokens(tokens: list[int]) -> list[int]:
    """The prompt without its image placeholders (for the sampler's penalties, `context`)."""
    return [t for t in tokens if t >= 0]


@dataclass
class ImageSpan:
    start: int  # index in the prompt's token list
    n_tokens: int
    chunk: object  # mtmd_input_chunk pointer, owned by the MediaPrompt's chunk list


@dataclass
class MediaPrompt:
    """A tokenized prompt with images; `free` releases mtmd's chunks (after the request)."""

    tokens: list[int]
    spans: dict[int, ImageSpan] = field(default_factory=dict)  # by start index
    chunks: list = field(default_factory=list)  # mtmd chunk lists, one per image

    @property
    def image_tokens(self) -> int:
        return sum(s.n_tokens for s in self.spans.values())

    def span_at(self, index: int) -> ImageSpan | None:
        """The image whose tokens include prompt index `index`, if any."""
        for span in self.spans.values():
            if span.start <= index < span.start + span.n_tokens:
                return span
        return None

    def free(self) -> None:
        for chunks in self.chunks:
            mtmd.mtmd_input_chunks_free(chunks)
        self.chunks.clear()
        self.spans.clear()


class Vision:
    """One projector loaded beside the language model; used from the engine's thread only."""

    def __init__(self, projector_path: str, model, *, use_gpu: bool, n_threads: int,
                 flash_attn: bool):
        _quiet_mtmd_debug()
        params = mtmd.mtmd_context_params_default()
        params.use_gpu = use_gpu
        params.n_threads = max(1, n_threads)
        params.print_timings = False
        params.warmup = True  # reserve the compute buffer now: an OOM fails the load
        params.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn
                                  else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        self.ctx = mtmd.mtmd_init_from_file(projector_path.encode(), model, params)
        if not self.ctx:
            raise ValueError(f"mtmd could not load the projector {projector_path} with this "
                             f"model (wrong projector for it? see the runner log)")
        if not mtmd.mtmd_support_vision(self.ctx):
            mtmd.mtmd_free(self.ctx)
            self.ctx = None
            raise ValueError(f"{projector_path} is not a vision projector")
        self.marker = mtmd.mtmd_default_marker().decode()
        self.mrope = bool(mtmd.mtmd_decode_use_mrope(self.ctx))
        self.on_gpu = use_gpu

    def close(self) -> None:
        if self.ctx:
            mtmd.mtmd_free(self.ctx)
            self.ctx = None

    # ---- prompt -> tokens ----------------------------------------------------------------
    def tokenize(self, prompt: str, images: tuple[str, ...], add_special: bool) -> MediaPrompt:
        """The prompt's tokens with each image's placeholders where its marker stands.

        `images` are base64 strings (the wire's), one per marker in order. One image is decoded
        at a time: the text up to and with its marker is tokenized with it (mtmd keeps the
        image resized for the projector, small) and its full-size bitmap freed before the next
        is decoded."""
        n_markers = prompt.count(self.marker)
        if n_markers != len(images):
            raise RequestError(f"the prompt has {n_markers} image markers but the request "
                               f"carries {len(images)} images")
        if self.mrope:
            raise RequestError("this projector places images with M-RoPE positions, which "
                               "localllm does not support yet")
        pieces = prompt.split(self.marker)
        out = MediaPrompt(tokens=[], chunks=[])
        try:
            for i, data in enumerate(images):
                raw = _decode_base64(data, i)
                bitmap = self._bitmap(raw, i)
                try:
                    self._tokenize(out, pieces[i] + self.marker, [bitmap],
                                   hashlib.sha256(raw).digest(), add_special and i == 0)
                finally:
                    mtmd.mtmd_bitmap_free(bitmap)
            if pieces[-1] or not images:
                self._tokenize(out, pieces[-1], [], b"", add_special and not images)
        except BaseException:
            out.free()
            raise
        return out

    def _bitmap(self, raw: bytes, i: int):
        buf = (ctypes.c_uint8 * len(raw)).from_buffer_copy(raw)
        bitmap = mtmd.mtmd_helper_bitmap_init_from_buf(self.ctx, buf, len(raw), False)
        if not bitmap:
            raise RequestError(f"image {i + 1} could not be decoded (PNG, JPEG, GIF or BMP; "
                               f"WebP needs ffmpeg on the runner's PATH)")
        if mtmd.mtmd_bitmap_is_audio(bitmap):
            mtmd.mtmd_bitmap_free(bitmap)
            raise RequestError(f"image {i + 1} is audio, not an image")
        return bitmap

    def _tokenize(self, out: MediaPrompt, text_part: str, bitmaps: list, digest: bytes,
                  add_special: bool) -> None:
        """Tokenize one piece of the prompt (text, then at most one image) onto `out`."""
        text = mtmd.mtmd_input_text()
        encoded = text_part.encode("utf-8", errors="replace")
        text.text, text.text_len = encoded, len(encoded)
        text.add_special, text.parse_special = add_special, True
        chunks = mtmd.mtmd_input_chunks_init()
        array = (mtmd.mtmd_bitmap_p_ctypes * max(1, len(bitmaps)))(*bitmaps)
        code = mtmd.mtmd_tokenize(self.ctx, chunks, ctypes.byref(text), array, len(bitmaps))
        if code != 0:
            mtmd.mtmd_input_chunks_free(chunks)
            raise RequestError("the projector could not prepare the images "
                               f"(mtmd_tokenize returned {code})")
        out.chunks.append(chunks)
        for i in range(mtmd.mtmd_input_chunks_size(chunks)):
            chunk = mtmd.mtmd_input_chunks_get(chunks, i)
            if mtmd.mtmd_input_chunk_get_type(chunk) == _CHUNK_TEXT:
                n = ctypes.c_size_t()
                ids = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
                out.tokens.extend(ids[j] for j in range(n.value))
                continue
            n_tokens = mtmd.mtmd_input_chunk_get_n_tokens(chunk)
            out.spans[len(out.tokens)] = ImageSpan(len(out.tokens), n_tokens, chunk)
            out.tokens.extend([placeholder(digest)] * n_tokens)

    # ---- an image into a sequence --------------------------------------------------------
    def read_image(self, lctx, span: ImageSpan, pos: int, seq_id: int, n_batch: int) -> None:
        """Encode one image and decode its embeddings at positions pos.. of `seq_id`."""
        code = mtmd.mtmd_encode_chunk(self.ctx, span.chunk)
        if code != 0:
            raise RuntimeError(f"the projector failed to encode the image (error {code})")
        embd = mtmd.mtmd_get_output_embd(self.ctx)
        new_pos = llama_cpp.llama_pos(0)
        code = mtmd.mtmd_helper_decode_image_chunk(
            self.ctx, lctx, span.chunk, embd, pos, seq_id, n_batch, ctypes.byref(new_pos),
            mtmd.mtmd_helper_post_decode_callback(0), None)
        if code != 0:
            raise RuntimeError(f"llama_decode failed on the image's embeddings (error {code})")


def _decode_base64(data: str, i: int) -> bytes:
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(f"image {i + 1} is not valid base64") from None
