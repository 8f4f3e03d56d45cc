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
- learned (`learned`): the mix of the requests a model served, from the daemon's record of
  their lengths (profiles.traffic): the first prompts, what each later turn adds, the
  answers.

A fill band above the first is entered by a prompt longer than the band below holds (a long
first prompt, or a conversation that grew past it): it is planned for reading that prompt and
the turns that follow (`entering`), while the first band serves the short requests
(`in_band`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace


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
        """The part of sessions a fill band of `band` tokens serves
        (profiles.bands.band_plans).

        A runner starts in the smallest band that holds a request's prompt, so a session whose
        first turn does not fit the band never runs in it: what the band serves then are the
        short requests, a chat's turns (an agent's side requests, a conversation that stays
        short). Without this, the band's plan priced a first prompt cut at the band's end, which
        never runs there, and chose micro-batches for reading it over decode speed."""
        if self.fill > 0 or self.first_prompt + self.answer <= band:
            return self
        return CHAT

    def entering(self, below: int, band: int) -> Workload:
        """The sessions a band above the first serves: they enter it with a prompt longer than
        the band `below` holds. The workload's own first prompt where it lands in the band;
        else a prompt of twice the band below (a 16K prompt enters an 8K-32K band), capped at
        the band, and turns as the workload's where its prompts are long, else as an agent's:
        a long prompt comes from an agent or an editor, and what follows it is tool results
        and short answers, not a chat's (priced with a chat's long answers, the band kept
        ubatch 512 for their decode and read the prompt at 60% of the agent plan's speed).
        Planned for short prompts, such a band read the prompt that loads it at half of
        llama.cpp's speed (issue 36)."""
        if self.fill > 0 or below < self.first_prompt and self.first_prompt + self.answer <= band:
            return self
        base = self if self.first_prompt >= LONG_PROMPT else AGENT
        first = max(below + 1, min(2 * below, band - base.answer))
        return replace(base, name=f"{base.name} (long prompt)", first_prompt=first)

    def describe(self) -> str:
        if self.fill > 0:
            return f"one answer filling {self.fill:.0%} of the context (expected_fill)"
        if self.turns <= 1 or self.turn_prompt <= 0:  # one request at a time, no follow-ups
            return (f"{self.name}: requests of about {self.first_prompt} tokens, each answered "
                    f"in about {self.answer}")
        return (f"{self.name}: conversations that open with about {self.first_prompt} tokens "
                f"and grow by about {self.turn_prompt} a turn over {self.turns} turns, answers "
                f"of about {self.answer} tokens")


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


LONG_PROMPT = 2048  # a first prompt of twice chat's or more: a learned mix is an agent's
MIN_LEARNED = 4  # requests served before the record replaces the starting workload


def learned(requests: list[tuple[int, int, int]]) -> Workload | None:
    """The mix of the requests a model served, each (prompt tokens, tokens read of them, answer
    tokens); None below MIN_LEARNED requests. A request that read most of its prompt started a
    session (its prompt is a first prompt); one that reused most of it continued one (what it
    read is a turn's addition). Medians, so one odd request moves nothing; the sessions are as
    deep as the longest prompts seen (the 90th percentile)."""
    if len(requests) < MIN_LEARNED:
        return None
    starts = [p for p, read, _ in requests if read * 2 >= p] or [p for p, _, _ in requests]
    turns_read = [read for p, read, _ in requests if read * 2 < p]
    first = max(1, _median(starts))
    answer = max(1, _median([a for _, _, a in requests]))
    turn = max(1, _median(turns_read)) if turns_read else 0
    deepest = sorted(p for p, _, _ in requests)[int(0.9 * (len(requests) - 1))]
    turns = 1 + (min(63, max(0, deepest - first) // (turn + answer)) if turn else 0)
    name = "agent" if first >= LONG_PROMPT else "chat"
    return Workload(name, first_prompt=first, turn_prompt=turn, answer=answer, turns=turns)


def _median(values: list[int]) -> int:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else 0


def objective_depth(n_ctx: int, workload: Workload) -> int:
    """The depth whose decode speed stands for the session's: decode time grows linearly with
    depth, so the answers' tokens over their time equal the speed at their mean depth."""
    turns = workload.session(n_ctx)
    answered = sum(t.answer for t in turns)
    if not answered:
        return 1
    mean = sum(t.answer * (t.start + t.prompt + t.answer / 2) for t in turns) / answered
    return max(1, int(mean))
