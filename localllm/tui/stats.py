"""The stats line: what the daemon measured, turned into one line that fits the terminal.

Every figure comes from the daemon: the runner's running totals on each streamed chunk
(`stats` on /api/chat lines) and its process figures from GET /api/stats. Nothing here is
guessed; a figure the daemon itself marks as a prediction (VRAM from the plan, where NVML
cannot see the runner) is shown with a `~`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from localllm.units import human_size

NS = 1_000_000_000
SEPARATOR = " │ "


@dataclass(frozen=True)
class TurnStats:
    """One answer's counters, as of the latest chunk (the runner's running totals)."""
    eval_count: int = 0
    eval_duration_ns: int = 0
    prompt_eval_count: int = 0
    prompt_eval_duration_ns: int = 0
    prompt_cached: int = 0  # prompt tokens the runner's cache held: not evaluated again
    context_used: int = 0
    context_length: int = 0
    ttft_ns: int | None = None
    drafted: int | None = None  # None: speculative decoding is off
    draft_accepted: int | None = None
    done: bool = False
    done_reason: str = ""

    @classmethod
    def from_wire(cls, stats: dict, done: bool = False, done_reason: str = "") -> TurnStats:
        draft = stats.get("draft") or {}
        return cls(
            eval_count=int(stats.get("eval_count", 0)),
            eval_duration_ns=int(stats.get("eval_duration", 0)),
            prompt_eval_count=int(stats.get("prompt_eval_count", 0)),
            prompt_eval_duration_ns=int(stats.get("prompt_eval_duration", 0)),
            prompt_cached=int(stats.get("prompt_eval_cached_count", 0)),
            context_used=int(stats.get("context_used", 0)),
            context_length=int(stats.get("context_length", 0)),
            ttft_ns=stats.get("time_to_first_token"),
            drafted=draft.get("drafted") if draft else None,
            draft_accepted=draft.get("accepted") if draft else None,
            done=done,
            done_reason=done_reason,
        )

    def to_wire(self) -> dict:
        """The shape from_wire reads (stored with each answer in the chat database)."""
        wire = {"eval_count": self.eval_count, "eval_duration": self.eval_duration_ns,
                "prompt_eval_count": self.prompt_eval_count,
                "prompt_eval_duration": self.prompt_eval_duration_ns,
                "prompt_eval_cached_count": self.prompt_cached,
                "context_used": self.context_used, "context_length": self.context_length,
                "time_to_first_token": self.ttft_ns, "done_reason": self.done_reason}
        if self.drafted is not None:
            wire["draft"] = {"drafted": self.drafted, "accepted": self.draft_accepted or 0}
        return wire

    @property
    def decode_rate(self) -> float | None:
        """Tokens per second over the whole answer so far."""
        if self.eval_count < 2 or self.eval_duration_ns <= 0:
            return None
        return self.eval_count * NS / self.eval_duration_ns

    @property
    def prompt_rate(self) -> float | None:
        # One token (a regenerate whose prompt was cached) is no rate: its time is the
        # request's overhead, and "prompt 1 tok at 1.2 tok/s" read as a slow machine.
        if self.prompt_eval_count < 2 or self.prompt_eval_duration_ns <= 0:
            return None
        return self.prompt_eval_count * NS / self.prompt_eval_duration_ns


class DecodeRate:
    """Live decode speed: tokens over the runner's own decode time, across the last `window_ns`.

    Both ends of the window are the runner's measurements, so network and rendering jitter do
    not move the figure; the window only smooths it.
    """

    def __init__(self, window_ns: int = NS):
        self.window_ns = window_ns
        self.samples: deque[tuple[int, int]] = deque()

    def reset(self) -> None:
        self.samples.clear()

    def add(self, eval_count: int, eval_duration_ns: int) -> None:
        if self.samples and eval_count <= self.samples[-1][0]:
            return
        self.samples.append((eval_count, eval_duration_ns))
        # Keep one sample older than the window so the window is always full once it can be.
        while len(self.samples) > 2 and \
                eval_duration_ns - self.samples[1][1] >= self.window_ns:
            self.samples.popleft()

    @property
    def rate(self) -> float | None:
        if len(self.samples) < 2:
            return None
        (count_a, ns_a), (count_b, ns_b) = self.samples[0], self.samples[-1]
        if ns_b <= ns_a:
            return None
        return (count_b - count_a) * NS / (ns_b - ns_a)


@dataclass(frozen=True)
class RunnerStats:
    """The runner process behind the chat's model, from GET /api/stats."""
    pid: int | None = None
    rss_bytes: int | None = None
    vram_bytes: int | None = None
    vram_estimated: bool = False  # the plan's figure: NVML could not see the runner
    gpu_layers: int = 0
    layers: int = 0
    kv_type: str = ""
    n_ctx: int = 0
    speculative: str = "off"
    reasons: tuple[str, ...] = ()
    plan_source: str = ""

    @classmethod
    def from_wire(cls, model: dict) -> RunnerStats:
        plan = model.get("plan") or {}
        return cls(
            pid=model.get("runner_pid"),
            rss_bytes=model.get("rss_bytes"),
            vram_bytes=model.get("vram_bytes"),
            vram_estimated=model.get("vram_source") == "plan",
            gpu_layers=int(plan.get("gpu_layers", 0)),
            layers=int(plan.get("layers", 0)),
            kv_type=str(plan.get("kv_type", "")),
            n_ctx=int(model.get("context_length") or plan.get("n_ctx") or 0),
            speculative=str(plan.get("speculative", "off")),
            reasons=tuple(plan.get("reasons") or ()),
            plan_source=str(plan.get("source", "")),
        )


def find_runner(stats: dict, model: str) -> RunnerStats | None:
    """The entry of /api/stats for `model` ('smollm2' matches 'smollm2:latest')."""
    wanted = model if ":" in model.rsplit("/", 1)[-1] else f"{model}:latest"
    for entry in stats.get("models", []):
        if entry.get("model") in (model, wanted):
            return RunnerStats.from_wire(entry)
    return None


# ---- formatting ------------------------------------------------------------------------------
def human_rate(tps: float) -> str:
    if tps >= 10_000:
        return f"{tps / 1000:.0f}k"
    if tps >= 1000:
        return f"{tps / 1000:.1f}k"
    return f"{tps:.1f}" if tps < 100 else f"{tps:.0f}"


def human_seconds(ns: int) -> str:
    seconds = ns / NS
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


@dataclass(frozen=True)
class Segment:
    text: str
    priority: int  # 0 is dropped last when the line is too narrow


def segments(turn: TurnStats | None, live_rate: float | None, runner: RunnerStats | None,
             streaming: bool) -> list[Segment]:
    """The stats line's parts, in display order, each with how much it matters."""
    out: list[Segment] = []
    if turn is not None:
        if streaming:
            rate = live_rate if live_rate is not None else turn.decode_rate
            out.append(Segment(f"▶ {human_rate(rate)} tok/s" if rate else "▶ … tok/s", 0))
        elif turn.decode_rate is not None:
            out.append(Segment(f"{human_rate(turn.decode_rate)} tok/s · {turn.eval_count} tok", 0))
        if turn.prompt_rate is not None:
            out.append(Segment(f"prompt {human_rate(turn.prompt_rate)} tok/s", 5))
        if turn.ttft_ns is not None:
            out.append(Segment(f"ttft {human_seconds(turn.ttft_ns)}", 6))
        if turn.drafted:
            accepted = turn.draft_accepted or 0
            out.append(Segment(f"draft {accepted}/{turn.drafted} "
                               f"{100 * accepted / turn.drafted:.0f}%", 3))
    # The loaded runner's context first: after /load the last answer's is the old model's.
    n_ctx = (runner.n_ctx if runner else 0) or \
        (turn.context_length if turn and turn.context_length else 0)
    if n_ctx:
        used = turn.context_used if turn else 0
        out.append(Segment(f"ctx {used}/{n_ctx} {100 * used / n_ctx:.0f}%", 1))
    if runner is not None:
        if runner.vram_bytes is not None and (runner.vram_bytes or runner.gpu_layers):
            mark = "~" if runner.vram_estimated else ""
            out.append(Segment(f"VRAM {mark}{human_size(runner.vram_bytes)}", 2))
        if runner.layers and runner.gpu_layers:
            out.append(Segment(f"GPU {runner.gpu_layers}/{runner.layers} layers", 3))
        elif runner.layers:
            out.append(Segment("CPU only", 3))
        if runner.rss_bytes is not None:
            # the process's resident memory: more than ps SIZE (the plan's weights and KV)
            out.append(Segment(f"runner RAM {human_size(runner.rss_bytes)}", 4))
        if runner.kv_type:
            out.append(Segment(f"KV {runner.kv_type}", 7))
    return out


def fit_line(parts: list[Segment], width: int) -> str:
    """Join the segments, dropping the least important until the line fits `width` cells."""
    kept = list(parts)
    while kept:
        line = SEPARATOR.join(s.text for s in kept)
        if len(line) <= width:
            return line
        kept.remove(max(kept, key=lambda s: (s.priority, kept.index(s))))
    return ""


def answer_footer(turn: TurnStats) -> str:
    """The line under a finished answer: what that answer cost, kept with the chat."""
    parts = []
    if turn.decode_rate is not None:
        parts.append(f"{human_rate(turn.decode_rate)} tok/s")
    parts.append(f"{turn.eval_count} tok")
    if turn.prompt_rate is not None:
        parts.append(f"prompt {turn.prompt_eval_count} tok at {human_rate(turn.prompt_rate)} tok/s")
    if turn.prompt_cached:
        parts.append(f"{turn.prompt_cached} prompt tok cached")
    if turn.ttft_ns is not None:
        parts.append(f"ttft {human_seconds(turn.ttft_ns)}")
    if turn.drafted:
        parts.append(f"draft {turn.draft_accepted or 0}/{turn.drafted}")
    if turn.done_reason == "cancelled":
        parts.append("stopped")
    return " · ".join(parts)


def format_timings(final: dict) -> str:
    """The block `ollama run --verbose` (and `/set verbose`) prints after an answer, from the
    last line's Ollama fields."""
    def rate(count, ns):
        return f"{count / (ns / 1e9):.2f} tokens/s" if ns else "n/a"

    draft = final.get("stats", {}).get("draft")
    cached = final.get("prompt_eval_cached_count", 0)
    drafts = [f"drafts accepted:      {draft['accepted']}/{draft['drafted']}"] if draft else []
    return "\n".join([
        f"total duration:       {final.get('total_duration', 0) / 1e9:.3f}s",
        f"load duration:        {final.get('load_duration', 0) / 1e9:.3f}s",
        f"prompt eval count:    {final.get('prompt_eval_count', 0)} token(s)"
        + (f" ({cached} cached)" if cached else ""),
        f"prompt eval duration: {final.get('prompt_eval_duration', 0) / 1e9:.3f}s",
        # The duration is that of the tokens read, not of those the cache held.
        f"prompt eval rate:     "
        f"{rate(final.get('prompt_eval_count', 0) - cached, final.get('prompt_eval_duration', 0))}",
        f"eval count:           {final.get('eval_count', 0)} token(s)",
        f"eval duration:        {final.get('eval_duration', 0) / 1e9:.3f}s",
        f"eval rate:            {rate(final.get('eval_count', 0), final.get('eval_duration', 0))}",
        *drafts,
    ])


def answer_notes(final: dict, looped: int, verbose: bool) -> list[tuple[str, str]]:
    """(text, kind) notes after an answer, from its last line: a loop stopped, the context
    full, the oldest messages left out to fit it, and with /set verbose the timings."""
    from localllm.repeats import LoopGuard

    notes = []
    if looped:
        notes.append((f"{LoopGuard.note(looped).capitalize()}.", "warning"))
    stats = final.get("stats", {})
    used, length = stats.get("context_used", 0), stats.get("context_length", 0)
    if final.get("done_reason") == "length" and length and used + 2 >= length:
        notes.append((f"The context is full ({used:,} of {length:,} tokens): the answer stopped "
                      "there. The next answer leaves the oldest turns out to make room; "
                      "/set parameter num_ctx N loads a larger context, /clear starts afresh.",
                      "warning"))
    if final.get("dropped_messages"):
        notes.append((f"The oldest {final['dropped_messages']} message(s) of this chat were "
                      f"left out of what the model read, to fit its context of {length:,} "
                      "tokens (they stay here and in the saved chat).", "warning"))
    if verbose and final:
        notes.append((format_timings(final), "info"))
    return notes
