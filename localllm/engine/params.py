"""llama.cpp's model and context parameters from a Plan, built once for every caller.

The runner loads with them, a dry run creates its metadata-only context with them, and the
evaluation builds its contexts with them: so the compute buffers a dry run measures are those of
the context the runner will create (the same sequences, recurrent-state snapshots, MTP layers,
tensor placement and remote devices).
"""

from __future__ import annotations

import ctypes

import llama_cpp
from localllm.planner.plan import Plan
from localllm.speculative import logit_rows

from .expert_cache import Settings as ExpertCacheSettings
from .overrides import apply_tensor_overrides

GGML_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8,
              "iq4_nl": 20, "bf16": 30}
# The draft-length rules are the Plan's, written once for the tuner and the runner alike.
rollback_positions = Plan.rollback_positions


def load_mode(plan: Plan) -> int:
    """llama.cpp's load mode for the plan's use_mmap. (0.3.36 replaced the `use_mmap` field by
    `load_mode`: an assignment to `use_mmap` sets a Python attribute and llama.cpp never sees it,
    so a profile's `use_mmap = false` changed nothing before this.)"""
    return llama_cpp.LLAMA_LOAD_MODE_MMAP if plan.use_mmap else llama_cpp.LLAMA_LOAD_MODE_NONE


def model_params(plan: Plan, metadata_only: bool = False):
    """(model params, what must stay alive until the model is loaded). `metadata_only`: read the
    header and plan the buffers without allocating (a dry run)."""
    params = llama_cpp.llama_model_default_params()
    params.n_gpu_layers = plan.n_gpu_layers
    params.load_mode = load_mode(plan)
    if not plan.extra_bufts:  # the engine crashed with them on this CPU (daemon/scheduler.py)
        params.use_extra_bufts = False
    elif plan.expert_cache:
        # The expert cache fills its pool with the experts' bytes as they sit in RAM: experts
        # repacked for the CPU's kernels cannot be cached (engine/expert_cache.py).
        params.use_extra_bufts = False
    elif plan.streamed_bytes and plan.use_mmap:
        # Past RAM the CPU's weights must stay the file's pages (engine/resident.py): repacked
        # for the CPU they would be anonymous copies, which cannot be read back from the file.
        params.use_extra_bufts = False
    params.load_mtp = plan.draft_mode.nextn  # llama.cpp skips the NextN layers otherwise
    if metadata_only:
        params.no_alloc = True
        params.load_mode = llama_cpp.LLAMA_LOAD_MODE_NONE
    keep_alive = [apply_tensor_overrides(params, plan.tensor_overrides)]
    if plan.tensor_split:
        # Layers per device (the workers', then the local GPUs'): llama.cpp cuts the GPU
        # layers at count / total, so whole-layer counts place each layer exactly.
        params.split_mode = llama_cpp.LLAMA_SPLIT_MODE_LAYER
        split = (ctypes.c_float * llama_cpp.LLAMA_MAX_DEVICES)(*plan.tensor_split)
        params.tensor_split = split
        keep_alive.append(split)
    if plan.rpc_workers:  # other machines' devices (`localllm worker`), then the local GPUs
        from .rpc import apply_devices

        keep_alive.append(apply_devices(params, plan.rpc_workers))
    return params, keep_alive


def context_params(plan: Plan, n_seq: int | None = None, n_batch: int | None = None,
                   every_row: bool = False):
    """Context parameters as the plan says: `n_seq` sequences (default: the plan's slots) of
    `plan.n_ctx` cells each, not unified, so slots never evict each other; logits for at most
    `speculative.logit_rows` rows a decode, or for `every_row` of a batch (an evaluation's
    perplexity)."""
    n_seq = max(1, plan.n_parallel) if n_seq is None else n_seq
    n_batch = plan.n_batch if n_batch is None else n_batch
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = plan.n_ctx * n_seq
    params.n_batch = n_batch
    params.n_ubatch = min(plan.n_ubatch, n_batch)
    params.n_seq_max = n_seq
    params.n_outputs_max = 0 if every_row else logit_rows(n_seq)
    params.n_threads = plan.n_threads
    params.n_threads_batch = plan.n_threads_batch
    params.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if plan.flash_attn
                              else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
    params.type_k = GGML_TYPES[plan.type_k]
    params.type_v = GGML_TYPES[plan.type_v]
    params.swa_full = plan.swa_full
    params.kv_unified = False
    params.n_rs_seq = plan.rollback_positions()
    params.embeddings = False
    params.no_perf = True
    return params


def expert_cache_settings(plan: Plan) -> ExpertCacheSettings | None:
    """The engine's expert cache settings for the plan's target context (engine/expert_cache.py);
    None: no pool."""
    if not plan.expert_cache:
        return None
    return ExpertCacheSettings(expert_cache=plan.expert_cache,
                               expert_cache_swaps=plan.expert_cache_swaps,
                               expert_misses_on_gpu=plan.expert_misses_on_gpu,
                               expert_cache_device=plan.expert_cache_device)
