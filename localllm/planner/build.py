"""The search's winner as a Plan: llama.cpp's load parameters (tensor overrides, layers per
device, batch sizes, threads), the slots and sliding-window cache that take what VRAM is left,
and the predictions and reasons `tune` shows."""

from __future__ import annotations

from dataclasses import replace

from localllm.modelstore.shape import ModelShape

from .card import Card
from .disk import disk_bytes_per_token
from .evaluator import Evaluator
from .explain import explain
from .memory import CPU, gpu_layers
from .placements import tensor_overrides
from .plan import Plan, cpu_plan
from .search import Option, Request, Search
from .host_reads import decode_threads
from .workload import objective_depth


def decode_by_depth(evaluator: Evaluator, best: Option) -> tuple[tuple[int, float], ...]:
    """Predicted decode at the start, the middle and the end of the context."""
    n = best.settings.n_ctx
    return tuple((d, round(evaluator.option_speed(best, d).decode_tps, 2))
                 for d in (0, n // 2, n))


TTFT_PROMPTS = (1024, 4096, 16384, 65536)


def time_to_first_token(evaluator: Evaluator, best: Option) -> tuple[tuple[int, float], ...]:
    """Predicted seconds to the first token of prompts of a few lengths, read into an empty
    context in the plan's micro-batches (and one decode step)."""
    s = best.settings
    cost, disk_s = evaluator.prompt_terms(best)
    out = []
    for n in TTFT_PROMPTS:
        if n >= s.n_ctx:
            break
        n_ub = -(-n // max(1, s.n_ubatch))
        first = 1.0 / max(1e-9, evaluator.option_speed(best, n).decode_tps)
        out.append((n, round(cost.seconds(n, s.n_ubatch) + n_ub * disk_s + first, 2)))
    return tuple(out)


def build_plan(shape: ModelShape, card: Card, request: Request, chosen: Search,
               searches: list[Search], evaluator: Evaluator,
               speculation_notes: list[str] | None = None) -> Plan:
    best = chosen.best
    assert best is not None
    single = best
    best, slot_note = evaluator.with_slots(best)
    full_swa = evaluator.with_full_swa(best, shape.chat_template is not None)
    if full_swa is not None:
        best = full_swa
    threads = request.n_threads or decode_threads(card)  # num_thread as asked
    s = best.settings
    if not card.has_gpu:
        base = cpu_plan(s.n_ctx, 0)
        batch = min(request.n_batch or base.n_batch, s.n_ctx)
        plan = replace(base, n_threads=threads, n_batch=batch, n_ubatch=min(base.n_ubatch, batch),
                       n_threads_batch=request.n_threads or base.n_threads_batch,
                       type_k=s.type_k, type_v=s.type_v, flash_attn=s.flash_attn)
    else:
        plan = Plan(
            n_ctx=s.n_ctx,
            n_gpu_layers=best.placement.n_gpu_layers,
            tensor_overrides=tensor_overrides(shape, best.placement),
            tensor_split=tuple(float(k) for _, k in gpu_layers(shape, card, best.placement)[1:])
            if card.n_gpus > 1 else (),
            device_layers=gpu_layers(shape, card, best.placement),
            gpus=tuple(g.index for g in card.gpu_list) if card.source == "probe" else (),
            type_k=s.type_k, type_v=s.type_v, flash_attn=s.flash_attn,
            n_batch=request.n_batch or max(2048, s.n_ubatch),
            n_ubatch=min(s.n_ubatch, request.n_batch or s.n_ubatch),
            # a prompt's batches are compute, not a read: all cores (or num_thread) there
            n_threads=threads, n_threads_batch=request.n_threads or card.cores,
        )
    chosen = replace(chosen, best=best)
    spec = best.speculation
    plan = replace(
        plan,
        speculative=spec.mode if spec else "off",
        draft_n_max=spec.draft_n_max if spec else 0,
        draft_n_gpu_layers=spec.draft_n_gpu_layers if spec else 0,
        predicted_plain_decode_tps=round(
            evaluator.speed(best.placement, best.settings,
                            objective_depth(s.n_ctx, request.workload)).decode_tps, 2),
    )
    streamed = disk_bytes_per_token(best.memory, evaluator.ram_budget)
    pinned = loads_pinned(card, plan, streamed)
    return replace(
        plan,
        n_parallel=s.n_seq,
        swa_full=s.swa_full,
        memory=best.memory,
        predicted_decode_tps=round(best.speed.decode_tps, 2),
        predicted_prefill_tps=round(best.speed.prefill_tps, 1),
        predicted_decode_by_depth=decode_by_depth(evaluator, best),
        predicted_ttft=time_to_first_token(evaluator, best),
        workload=request.workload.describe(),
        workload_source=request.workload_source,
        predicted_session_s=round(best.session_seconds, 1),
        streamed_bytes=streamed,
        pin_in_place=pinned,
        reasons=tuple(explain(shape, card, request, chosen, searches, evaluator, threads,
                              single, slot_note, speculation_notes or []))
        + ((PINNED_REASON,) if pinned else ()),
        source="tuner",
    )


PINNED_REASON = ("weights in RAM pinned for the GPU where the file maps them (pin_in_place): "
                 "a prompt's micro-batches copy them to the GPU at PCIe speed, not at the 7 GB/s "
                 "of pageable memory (speed.py), with no second copy of them to load")


def loads_pinned(card: Card, plan: Plan, streamed_bytes: int) -> bool:
    """Whether a plan pins its RAM-resident weights for the GPU (engine/host_pin.py) rather than
    leaving them pageable: on a GPU, with blocks or tensors of blocks in RAM (the token table
    always is; alone it never crosses), all within the RAM budget (past RAM the file's pages
    must stay evictable: planner/disk.py)."""
    blocks_in_ram = any(device == CPU and n for device, n in plan.device_layers)
    return card.has_gpu and (blocks_in_ram or bool(plan.tensor_overrides)) \
        and not streamed_bytes
