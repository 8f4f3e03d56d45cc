"""llama.cpp through its C API: load a model and a context as a Plan says, tokenize, detokenize.

Runs inside the runner process only. The high-level `Llama` class is not used: it scans the KV
cache on every token, keeps numpy copies of the logits and cannot hold several sequences, tensor
placement overrides or remote devices. Everything here is a thin, typed layer over the binding.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import llama_cpp
from localllm.profiles.llama_overrides import apply_tensor_overrides
from localllm.profiles.plan import Plan

GGML_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8,
              "bf16": 30, "iq4_nl": 20}


class ModelLoadError(Exception):
    """llama.cpp refused the model or the context (the message says which)."""


@dataclass
class LoadedModel:
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


def load(model_path: str, plan: Plan, rollback: int = 0) -> LoadedModel:
    """The model with the plan's placement and a context of `plan.n_parallel` sequences, each
    with `plan.n_ctx` cells of its own (non-unified KV: slots never evict each other).

    With `plan.speculative == "mtp"` the NextN layers are loaded too (llama.cpp skips them
    otherwise). `rollback`: how many positions a recurrent state must be able to take back
    (rejected drafts); llama.cpp keeps that many snapshots of it per sequence."""
    llama_cpp.llama_backend_init()
    mparams = llama_cpp.llama_model_default_params()
    mparams.n_gpu_layers = plan.n_gpu_layers
    mparams.use_mmap = plan.use_mmap
    mparams.load_mtp = plan.speculative == "mtp"
    keep_alive = [apply_tensor_overrides(mparams, plan.tensor_overrides)]
    if plan.tensor_split:
        split = (ctypes.c_float * llama_cpp.LLAMA_MAX_DEVICES)(*plan.tensor_split)
        mparams.tensor_split = split
        keep_alive.append(split)
    if plan.rpc_workers:  # other machines' devices (`localllm worker`), then the local GPUs
        from localllm.profiles.rpc import apply_devices

        keep_alive.append(apply_devices(mparams, plan.rpc_workers))
    model = llama_cpp.llama_model_load_from_file(model_path.encode(), mparams)
    if not model:
        raise ModelLoadError(f"llama.cpp could not load {model_path} (see the runner log)")
    n_seq = max(1, plan.n_parallel)
    cparams = context_params(plan, n_seq, plan.n_batch)
    cparams.n_rs_seq = rollback
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    if not ctx:
        llama_cpp.llama_model_free(model)
        raise ModelLoadError("llama.cpp could not create the context (out of memory for the "
                             "KV cache or compute buffers? see the runner log)")
    vocab = llama_cpp.llama_model_get_vocab(model)
    recurrent = bool(llama_cpp.llama_model_is_recurrent(model)
                     or llama_cpp.llama_model_is_hybrid(model))
    return LoadedModel(
        model=model, ctx=ctx, vocab=vocab, memory=llama_cpp.llama_get_memory(ctx),
        n_ctx_seq=llama_cpp.llama_n_ctx_seq(ctx), n_batch=llama_cpp.llama_n_batch(ctx),
        n_seq=llama_cpp.llama_n_seq_max(ctx), n_vocab=llama_cpp.llama_vocab_n_tokens(vocab),
        n_swa=0 if plan.swa_full else llama_cpp.llama_model_n_swa(model),
        recurrent=recurrent, n_rollback=llama_cpp.llama_n_rs_seq(ctx),
    )


def context_params(plan: Plan, n_seq: int, n_batch: int):
    """Context parameters as the plan says: `n_seq` sequences of `plan.n_ctx` cells each."""
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx = plan.n_ctx * n_seq
    cparams.n_batch = n_batch
    cparams.n_ubatch = min(plan.n_ubatch, n_batch)
    cparams.n_seq_max = n_seq
    cparams.n_threads = plan.n_threads
    cparams.n_threads_batch = plan.n_threads_batch
    cparams.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if plan.flash_attn
                               else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
    cparams.type_k = GGML_TYPES[plan.type_k]
    cparams.type_v = GGML_TYPES[plan.type_v]
    cparams.swa_full = plan.swa_full
    cparams.kv_unified = False
    cparams.embeddings = False
    cparams.no_perf = True
    return cparams


class Tokenizer:
    """Text <-> tokens with the model's vocabulary."""

    def __init__(self, model: llama_cpp.llama_model_p, vocab: llama_cpp.llama_vocab_p):
        self.model = model
        self.vocab = vocab
        self._piece_buf = ctypes.create_string_buffer(256)
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(vocab))
        self.bos = llama_cpp.llama_vocab_bos(vocab)
        self.eos = llama_cpp.llama_vocab_eos(vocab)
        self.bos_piece = self.piece(self.bos, special=True)
        self.eos_piece = self.piece(self.eos, special=True)

    def tokenize(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Special tokens in `text` are parsed; a BOS is added when the model wants one and the
        text does not already start with it (a chat template often writes it itself)."""
        if add_bos is None:
            add_bos = self.add_bos and not (self.bos_piece and text.startswith(self.bos_piece))
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
        buf = self._piece_buf
        n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        if n < 0:
            big = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self.vocab, token, big, len(big), 0, special)
            return big.raw[:n]
        return buf.raw[:n]

    def piece(self, token: int, special: bool = True) -> str:
        if token < 0:
            return ""
        return self.token_bytes(token, special).decode("utf-8", errors="replace")

    def is_eog(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self.vocab, token))

    def metadata(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(1 << 16)
        n = llama_cpp.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        if n < 0:
            return None
        if n >= len(buf):
            buf = ctypes.create_string_buffer(n + 1)
            llama_cpp.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", errors="replace")
