"""Workload: the session a plan is made for, as prompt lengths and answer lengths.

A plan made for one fill level is wrong for the rest of the session: after a short prompt whole
blocks on the GPU decode fastest, deep in the context every block's attention must be on the GPU,
and a long prompt is read fastest with large micro-batches. So the tuner prices a whole session:
its turns, each reading the tokens it adds (at the depth the context has reached) and decoding
its answer (slower as the context fills), and minimizes the total time.

- chat: a short first prompt, a few turns of a message and an answer each; most conversations
  never get deep.
- agent: a long system prompt with tool definitions, then turns that each add tool results and
  answer briefly, growing to 64K tokens and more (coding agents send 10-30K tokens at once).
- fill (the older `expected_fill`): one short prompt, then an answer that fills that part of
  the context; the plan then maximizes decode averaged over the fill, as it used to.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Turn:
    start: int  # tokens in the context before this turn's prompt
    prompt: int  # tokens the turn adds and the model reads
    answer: int  # tokens it decodes

    @property
    def end(self) -> int:
        return self.start + self.prompt + self.answer


@dataclass(frozen=True)
class Workload:
    name: str
    first_prompt: int  # tokens of the first prompt (system prompt, tools, first message)
    turn_prompt: int  # tokens each later turn adds (a message, tool results)
    answer: int  # tokens of each answer
    turns: int  # turns in all, the first included
    fill: float = 0.0  # > 0: the older expected_fill (one answer filling this part of n_ctx)

    def session(self, n_ctx: int) -> tuple[Turn, ...]:
        """The turns that fit in a context of n_ctx; the last one is cut where it ends."""
        if self.fill > 0:
            return (Turn(0, 0, max(1, int(n_ctx * self.fill))),)
        out = []
        depth = 0
        for i in range(self.turns):
            prompt = self.first_prompt if i == 0 else self.turn_prompt
            room = n_ctx - depth
            if room <= 1:
                break
            prompt = min(prompt, room - 1)
            answer = min(self.answer, room - prompt)
            out.append(Turn(depth, prompt, answer))
            depth += prompt + answer
        return tuple(out)

    def in_band(self, band: int) -> Workload:
        """The part of sessions a fill band of `band` tokens serves (profiles.bands.band_plans).

        A runner starts in the smallest band that holds a request's prompt, so a session whose
        first turn does not fit the band never runs in it: what the band serves then are the
        short requests, a chat's turns (an agent's side requests, a conversation that stays
        short). Without this, the band's plan priced a first prompt cut at the band's end, which
        never runs there, and chose micro-batches for reading it over decode speed."""
        if self.fill > 0 or self.first_prompt + self.answer <= band:
            return self
        return CHAT

    def describe(self) -> str:
        if self.fill > 0:
            return f"one answer filling {self.fill:.0%} of the context (expected_fill)"
        return (f"{self.name}: a {self.first_prompt}-token first prompt, then "
                f"{self.turns - 1} turns adding {self.turn_prompt} tokens each, answers of "
                f"{self.answer}")


CHAT = Workload("chat", first_prompt=1024, turn_prompt=256, answer=400, turns=8)
AGENT = Workload("agent", first_prompt=20000, turn_prompt=2048, answer=256, turns=24)
WORKLOADS = {"chat": CHAT, "agent": AGENT}


def from_fill(fill: float) -> Workload:
    return Workload(f"fill {fill:g}", 0, 0, 0, 1, fill=fill)


HALF_FILL = from_fill(0.5)


def named(name: str) -> Workload:
    """A workload by name (chat, agent); ValueError names the known ones."""
    try:
        return WORKLOADS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; use {', '.join(WORKLOADS)}") from None


def objective_depth(n_ctx: int, workload: Workload) -> int:
    """The depth whose decode speed stands for the session's: decode time grows linearly with
    depth, so the answers' tokens over their time equal the speed at their mean depth."""
    turns = workload.session(n_ctx)
    answered = sum(t.answer for t in turns)
    if not answered:
        return 1
    mean = sum(t.answer * (t.start + t.prompt + t.answer / 2) for t in turns) / answered
    return max(1, int(mean))
