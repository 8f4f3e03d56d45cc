"""llama.cpp through its C API: load a model and a context as a Plan says, tokenize, detokenize.

Runs inside the runner process only. The high-level `Llama` class is not used: it scans the KV
cache on every token, keeps numpy copies of the logits and cannot hold several sequences, tensor
placement overrides or remote devices. Everything here is a thin, typed layer over the binding.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import signal
from dataclasses import dataclass, replace

import llama_cpp
from localllm.planner.plan import Plan

from localllm.speculative import MAX_DRAFT, logit_rows

from . import expert_cache
from .host_pin import PinnedMapping, pin_mapped
from .params import context_params, expert_cache_settings, model_params
from .resident import ResidentWeights
from .text_pieces import PIECE_CHARS, markers_pattern, pieces


log = logging.getLogger("localllm.runner.model")
# A test hook: the runner dies of SIGSEGV at its self-check decode, as an engine whose kernels
# crash on this CPU does. "extra_bufts": only while llama.cpp's extra buffer types are on (the
# AMX crash of issue #32); "always": whatever the plan.
CRASH_HOOK = "LOCALLLM_TEST_ENGINE_CRASH"


class ModelLoadError(Exception):
    """llama.cpp refused the model or the context (the message says which)."""


class RequestError(Exception):
    """The request cannot be served as asked (status 400): prompt too long, bad grammar."""

    sizes: tuple[int, ...] = ()  # (prompt tokens, n_ctx) when the prompt did not fit


class PromptTooLong(RequestError):
    """A prompt longer than the loaded context: its size and the context's travel with the
    message, for the daemon to word it as each API's clients read an overflow."""

    def __init__(self, message: str, tokens: int, n_ctx: int):
        super().__init__(message)
        self.sizes = (tokens, n_ctx)


@dataclass
class LlamaModel:
    model: llama_cpp.llama_model_p
    ctx: llama_cpp.llama_context_p
    vocab: llama_cpp.llama_vocab_p
    memory: llama_cpp.llama_memory_t
    n_ctx_seq: int  # KV cells each sequence (slot) may use
    n_batch: int
    n_seq: int
    n_vocab: int
    n_swa: int  # sliding window of the SWA layers; 0 when there are none or the cache is full
    recurrent: bool  # recurrent or hybrid: the state cannot be cut back to an earlier position
    n_rollback: int  # ... except by this many positions (recurrent-state snapshots)
    n_logit_rows: int  # rows a decode may ask logits for (speculative.logit_rows)
    resident: ResidentWeights | None = None  # past RAM: the weights locked in RAM
    pinned: PinnedMapping | None = None  # the mapped weights pinned in place for the GPU
    # How the weights in RAM really sit: "mapped" (the file's pages), "pinned in place" (those
    # pages, pinned for the GPU) or "copied" (load_mode none: a copy, in the GPU's pinned host
    # buffer on a GPU). A plan that asks to pin in place gets "copied" when the driver refuses.
    weights_in_ram: str = "mapped"


def load(model_path: str, plan: Plan) -> LlamaModel:
    """The model with the plan's placement and a context of `plan.n_parallel` sequences, each
    with `plan.n_ctx` cells of its own (engine/params.py builds both, as dry runs do)."""
    llama_cpp.llama_backend_init()
    mparams, keep_alive = model_params(plan)
    model = llama_cpp.llama_model_load_from_file(model_path.encode(), mparams)
    del keep_alive  # llama.cpp has copied the patterns and devices while loading
    if not model:
        raise ModelLoadError(f"llama.cpp could not load {model_path} (see the runner log)")
    pinned = None
    if plan.pin_in_place and plan.use_mmap:
        pinned = pin_mapped(model_path)
        if pinned.error:
            log.warning("could not pin the mapped weights in place (%s): loading them into "
                        "pinned memory instead", pinned.error)
            llama_cpp.llama_model_free(model)
            return load(model_path, replace(plan, use_mmap=False, pin_in_place=False))
        log.info("pinned %.1f GiB of mapped weights in place for the GPU",
                 pinned.pinned_bytes / 2**30)
    choose_grouped_attention(model)
    # this context alone gets a pool
    with expert_cache.switched_on(expert_cache_settings(plan)):
        ctx = llama_cpp.llama_init_from_model(model, context_params(plan))
    if not ctx:
        if pinned is not None:
            pinned.release()
        llama_cpp.llama_model_free(model)
        raise ModelLoadError("llama.cpp could not create the context (out of memory for the "
                             "KV cache or compute buffers? see the runner log)")
    resident = None
    if plan.streamed_bytes and plan.use_mmap:
        resident = ResidentWeights(model_path, plan)
        (log.warning if resident.error else log.info)("past RAM: %s", resident.describe())
    vocab = llama_cpp.llama_model_get_vocab(model)
    if not plan.streamed_bytes:  # past RAM one token costs seconds; extra buffers are off there
        self_check(ctx, vocab, plan)
    recurrent = bool(llama_cpp.llama_model_is_recurrent(model)
                     or llama_cpp.llama_model_is_hybrid(model))
    return LlamaModel(
        model=model, ctx=ctx, vocab=vocab, memory=llama_cpp.llama_get_memory(ctx),
        n_ctx_seq=llama_cpp.llama_n_ctx_seq(ctx), n_batch=llama_cpp.llama_n_batch(ctx),
        n_seq=llama_cpp.llama_n_seq_max(ctx), n_vocab=llama_cpp.llama_vocab_n_tokens(vocab),
        n_swa=0 if plan.swa_full else llama_cpp.llama_model_n_swa(model),
        recurrent=recurrent, n_rollback=llama_cpp.llama_n_rs_seq(ctx),
        n_logit_rows=logit_rows(llama_cpp.llama_n_seq_max(ctx)), resident=resident,
        pinned=pinned, weights_in_ram="pinned in place" if pinned is not None
        else "mapped" if plan.use_mmap else "copied",
    )


def self_check(ctx, vocab, plan: Plan) -> None:
    """Decode one token before the runner reports ready, then forget it: a kernel that crashes
    on this CPU crashes here, while loading, where the daemon names it and retries without extra
    buffer types, rather than in the middle of someone's answer."""
    hook = os.environ.get(CRASH_HOOK)
    if hook == "always" or (hook == "extra_bufts" and plan.extra_bufts):
        os.kill(os.getpid(), signal.SIGSEGV)
    token = llama_cpp.llama_vocab_bos(vocab)
    if token < 0:
        token = 0
    tokens = (llama_cpp.llama_token * 1)(token)
    code = llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(tokens, 1))
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
    if code != 0:
        raise ModelLoadError(f"llama.cpp could not decode one token after loading (code {code}; "
                             "see the runner log)")


class Tokenizer:
    """Text <-> tokens with the model's vocabulary."""

    def __init__(self, model: llama_cpp.llama_model_p, vocab: llama_cpp.llama_vocab_p):
        self.model = model
        self.vocab = vocab
        self._piece_buf = ctypes.create_string_buffer(256)
        self._pieces: dict[bool, dict[int, bytes]] = {False: {}, True: {}}
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(vocab))
        self.bos = llama_cpp.llama_vocab_bos(vocab)
        self.eos = llama_cpp.llama_vocab_eos(vocab)
        self.bos_piece = self.piece(self.bos, special=True)
        self.eos_piece = self.piece(self.eos, special=True)
        self._markers: re.Pattern | None | bool = False  # False: not built yet

    def markers(self) -> re.Pattern | None:
        """The special tokens a long text may be cut before (engine/text_pieces.py), found in
        the vocabulary once, at the first long text."""
        if self._markers is False:
            special = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED
            texts = []
            for token in range(llama_cpp.llama_vocab_n_tokens(self.vocab)):
                attr = llama_cpp.llama_vocab_get_attr(self.vocab, token)
                if attr & special and not attr & llama_cpp.LLAMA_TOKEN_ATTR_LSTRIP:
                    text = llama_cpp.llama_vocab_get_text(self.vocab, token)
                    texts.append((text or b"").decode("utf-8", errors="replace"))
            self._markers = markers_pattern(texts)
        return self._markers

    def tokenize(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Special tokens in `text` are parsed; a BOS is added when the model wants one and the
        text does not already start with it (a chat template often writes it itself). A long
        text is tokenized in pieces cut before special tokens: the same tokens, in linear time
        (engine/text_pieces.py)."""
        if add_bos is None:
            add_bos = self.add_bos and not (self.bos_piece and text.startswith(self.bos_piece))
        if len(text) <= PIECE_CHARS:
            return self._tokenize(text, add_bos)
        tokens: list[int] = []
        for i, piece in enumerate(pieces(text, self.markers())):
            tokens += self._tokenize(piece, add_bos and i == 0)
        return tokens

    def _tokenize(self, text: str, add_bos: bool) -> list[int]:
        data = text.encode("utf-8", errors="replace")
        capacity = len(data) + 8
        while True:
            buf = (llama_cpp.llama_token * capacity)()
            n = llama_cpp.llama_tokenize(self.vocab, data, len(data), buf, capacity, add_bos,
                                         True)
            if n >= 0:
                return list(buf[:n])
            capacity = -n

    def token_bytes(self, token: int, special: bool = False) -> bytes:
        # A token's piece never changes: every answered token asks for one, on the runner's
        # path between two decode steps, and a dict lookup is a fraction of a ctypes call.
        pieces = self._pieces[special]
        piece = pieces.get(token)
        if piece is not None:
            return piece
        buf = self._piece_buf
        n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        if n < 0:
            big = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self.vocab, token, big, len(big), 0, special)
            piece = big.raw[:n]
        else:
            piece = buf.raw[:n]
        pieces[token] = piece
        return piece

    def piece(self, token: int, special: bool = True) -> str:
        if token < 0:
            return ""
        return self.token_bytes(token, special).decode("utf-8", errors="replace")

    def is_eog(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self.vocab, token))

    def metadata(self, key: str) -> str | None:
        return model_metadata(self.model, key)


def model_metadata(model, key: str) -> str | None:
    """A GGUF metadata value of a loaded model, as text (None: the file has no such key)."""
    buf = ctypes.create_string_buffer(1 << 16)
    n = llama_cpp.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    if n < 0:
        return None
    if n >= len(buf):
        buf = ctypes.create_string_buffer(n + 1)
        llama_cpp.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    return buf.value.decode("utf-8", errors="replace")


GROUPED_ATTENTION = "LOCALLLM_FA_VEC_GQA"  # read once by the engine, at its first decode
GROUPED_ATTENTION_MAX_HEAD = 128


def choose_grouped_attention(model) -> None:
    """Patch 0007's decode kernel (a block takes the query heads of one KV head over a quantized
    cache) only for heads up to GROUPED_ATTENTION_MAX_HEAD wide, unless the environment says.
    On an H100 (test-backend-ops, one token, 8 query heads a KV head, q8_0) it took 7% off the
    kernel at 16K cells and 26% at 32K with heads of 128, and added 30% at 32K with heads of 256
    (lab/runs/h100-2026-12-07b-moe-ways.md); the engine itself turns it on only where its blocks
    fill the GPU (a long cache)."""
    if GROUPED_ATTENTION in os.environ:
        return
    if head_size(model) > GROUPED_ATTENTION_MAX_HEAD:
        os.environ[GROUPED_ATTENTION] = "0"


def head_size(model) -> int:
    """The model's attention head size (its key length; n_embd / n_head where it has none)."""
    arch = model_metadata(model, "general.architecture")
    length = model_metadata(model, f"{arch}.attention.key_length") if arch else None
    if length and length.isdigit():
        return int(length)
    return llama_cpp.llama_model_n_embd(model) // max(1, llama_cpp.llama_model_n_head(model))


def batch_capacity(lm: LlamaModel) -> int:
    """Rows a step's batch may need: a prompt chunk of n_batch, and each slot's token with its
    longest draft."""
    return lm.n_batch + lm.n_seq * (1 + MAX_DRAFT)


def free(lm: LlamaModel) -> None:
    """Give back the context and the model (their VRAM and RAM): a band switch loads another
    placement of the same file (engine.py)."""
    llama_cpp.llama_free(lm.ctx)
    if lm.pinned is not None:  # a registered range must not be unmapped
        lm.pinned.release()
    llama_cpp.llama_model_free(lm.model)
    if lm.resident is not None:
        lm.resident.close()
