"""Fill bands in the runner: the RunnerEngine starts in a small context's plan (the tuner's, for
less KV and more weights on the GPU) and, before a sequence outgrows it, moves to the next
band's: every sequence's state saved to RAM (engine/state.py), the model reloaded with the new
placement, the states restored (a band with another KV type reads them again instead). A
request whose prompt and answer room (its num_predict, ANSWER_ROOM at most) pass the band moves
it as it starts, before its prompt is read: the reload then comes before the first token, not
in the middle of the answer (an agent's turn that crossed 32K mid-answer decoded at 28 tok/s
where the turns around it did 60); only an answer longer than that room moves it mid-answer.

It moves down again when the loaded band has not been needed for DOWN_AFTER_S (an agent's
long conversation that went quiet; a user back to short chats): as the next request starts,
to the smallest band that holds every busy sequence. An idle sequence too long for that band
goes to the prompt cache where there is one (else it is read again if its conversation comes
back). The wait is long, as Ollama's keep_alive is: an agent alternating a long main thread
with short side requests must not pay a reload each way.

One object the runner's RunnerEngine (engine.py) holds, because it owns one thing: the switch. It
reloads the model (engine/loaded.py), rebuilds what is bound to it in the slots (the samplers'
grammars), sets the new sizes in the engine's Room and reports the pause (`on_band`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

from localllm.engine import state
from localllm.engine.loaded import LoadedModel
from localllm.engine.model import ModelLoadError
from localllm.planner.plan import Plan

from .protocol import Band, Progress
from .slots import Room, Slot

log = logging.getLogger("localllm.runner")

DOWN_AFTER_S = 300.0  # the loaded band unneeded this long: the next request moves down
DOWN_AFTER_VARIABLE = "LOCALLLM_BAND_DOWN_AFTER_S"  # another wait, for tests and tuning
ANSWER_ROOM = 512  # answer tokens a band moved to holds beyond each prompt (at most)
ANSWER_ROOM_VARIABLE = "LOCALLLM_BAND_ANSWER_ROOM"  # another room: 0 moves up only when outgrown


def _setting(variable: str, default):
    """A number from the environment (of the default's type, at least 0), else the default."""
    try:
        return max(type(default)(0), type(default)(os.environ.get(variable, default)))
    except ValueError:
        return default


def answer_room() -> int:
    return _setting(ANSWER_ROOM_VARIABLE, ANSWER_ROOM)


def down_after_seconds() -> float:
    return _setting(DOWN_AFTER_VARIABLE, DOWN_AFTER_S)


class FillBands:
    def __init__(self, plans: tuple[Plan, ...], start: int, model: LoadedModel,
                 slots: list[Slot], room: Room,
                 stash: Callable[[Slot], None] | None = None):
        """`plans`: one per band, smallest context first; the last holds the whole context.
        `stash` saves an idle slot's sequence to the prompt cache before a move down drops
        it."""
        self.plans = plans
        self.band = max(0, min(start, len(plans) - 1))
        self.model = model
        self.slots = slots
        self.room = room
        self.stash = stash
        self.down_after_s = down_after_seconds()
        self.answer_room = answer_room()
        self.needed_at = time.monotonic()  # when a sequence last needed the loaded band
        self.pauses: list[float] = []  # seconds each switch stopped decoding
        self.on_band: Callable[[Band], None] | None = None  # after each switch

    @property
    def plan(self) -> Plan:
        """The plan of the band loaded now."""
        return self.plans[self.band]

    @property
    def last(self) -> bool:
        """Whether the band loaded is the one that holds the whole context."""
        return self.band == len(self.plans) - 1

    def follow(self) -> Plan | None:
        """Move up to the next fill band's plan before a sequence outgrows the loaded one, or
        down as a request starts once the loaded band has gone unneeded (the module's head).
        The new band's plan, or None when the loaded one stays."""
        now = time.monotonic()
        busy = [s for s in self.slots if not s.free]
        need = max((self._need(s) for s in busy), default=0)
        if self.band and need > self.plans[self.band - 1].n_ctx:
            self.needed_at = now
        if not self.last and need > self.room.seq:
            target = next((i for i in range(self.band + 1, len(self.plans))
                           if self.plans[i].n_ctx >= need), len(self.plans) - 1)
            self._switch(target, f"a sequence needs {need} tokens, the "
                                 f"{self.plan.n_ctx}-token band holds {self.room.seq}")
            self.needed_at = now
            return self.plan
        if not self.band or now - self.needed_at < self.down_after_s \
                or not any(s.reading_prompt for s in busy):
            return None
        # not a band the answers outgrow at once
        need = max(len(s.tokens) + len(s.to_decode) + self._room(s) for s in busy)
        target = next((i for i in range(self.band) if self.plans[i].n_ctx >= need), self.band)
        if target == self.band:
            return None
        for slot in self.slots:  # idle sequences too long for the smaller band
            if slot.free and len(slot.tokens) + 1 > self.plans[target].n_ctx:
                if self.stash is not None:
                    self.stash(slot)
                slot.tokens = []
                slot.checkpoints.clear()
        self._switch(target, f"no sequence has needed the {self.plan.n_ctx}-token band for "
                             f"{now - self.needed_at:.0f} s")
        self.needed_at = now
        return self.plan

    def _room(self, slot: Slot) -> int:
        """Answer tokens a band must hold beyond the sequence's prompt (at least the next)."""
        return max(1, min(slot.work.limit, self.answer_room))

    def _need(self, slot: Slot) -> int:
        """Tokens the loaded band must hold for this sequence now: while its prompt is read,
        the prompt and its answer's room; while it answers, the next token."""
        room = self._room(slot) if slot.reading_prompt else 1
        return len(slot.tokens) + len(slot.to_decode) + room

    def _switch(self, target: int, why: str) -> None:
        """Save every sequence's state to RAM, load the target band's plan (the same file,
        another placement and context), restore the states; a sequence whose state the new
        context refuses (another KV type) is read again from its tokens."""
        started = time.perf_counter()
        old, new = self.plans[self.band], self.plans[target]
        why = f"{why}: moving to the {new.n_ctx}-token band's plan"
        busy = [slot for slot in self.slots if not slot.free]
        for slot in busy:  # the other requests wait through the reload: they are told
            slot.work.emit(Progress(len(slot.tokens), len(slot.work.prompt), note=why))
        saved = {slot.seq_id: state.save(self.model.lm.ctx, slot.seq_id, slot.tokens)
                 for slot in self.slots if slot.tokens}
        for work in (slot.work for slot in busy):
            work.sampler.free()  # the grammar holds the vocabulary of the model unloaded now
        try:
            self.model.reload(new)
        except ModelLoadError as e:
            # The plan's memory was wrong for this band: the band that was loaded fit, so it
            # is loaded again and holds the whole context from now on (a sequence that needs
            # more ends with "length").
            log.error("band: loading the %d-token band failed (%s); staying in the %d-token "
                      "band", new.n_ctx, e, old.n_ctx)
            try:
                self.model.reload(old)
            except ModelLoadError as again:
                log.critical("band: the %d-token band no longer loads either (%s)",
                             old.n_ctx, again)
                raise SystemExit(1) from None  # the daemon fails the requests and reloads
            if target > self.band:
                self.plans = self.plans[:self.band + 1]
            else:  # a move down that failed: stay, and try no other
                self.down_after_s = float("inf")
            target, new = self.band, old
            why = f"{why} failed (out of memory?); stayed in the {old.n_ctx}-token band"
        self.band = target
        self.room.seq = self.model.lm.n_ctx_seq
        if self.last:
            self.room.n_ctx = min(self.room.n_ctx, self.room.seq)
        carried = reread = 0
        for slot in self.slots:
            copy = saved.get(slot.seq_id)
            if copy is None:
                continue
            if state.restore(self.model.lm.ctx, slot.seq_id, copy):
                carried += 1  # its checkpoints hold the same types: they stay good
                continue
            slot.checkpoints.clear()  # of the KV type the new context refused
            if slot.work is None:  # an idle slot's prompt: the next request reads it anew
                slot.tokens = []
                continue
            reread += len(slot.tokens)
            slot.work.emit(Progress(0, len(slot.tokens), note=(
                f"reading the {len(slot.tokens)} tokens of this conversation again: the "
                f"{new.n_ctx}-token band's KV type differs")))
            slot.replaying += len(slot.tokens)
            slot.unread += len(slot.tokens)
            slot.to_decode = slot.tokens + slot.to_decode
            slot.tokens = []
        for slot in busy:
            work = slot.work
            work.sampler = self.model.sampler(work.request.options, work.request.grammar,
                                              work.prompt, self.room.n_ctx)
            for token in work.answer:  # the grammar's state and the penalties' history
                work.sampler.accept(token)
        pause = time.perf_counter() - started
        self.pauses.append(pause)
        note = (f"{why}; reloaded and carried {carried} sequences over in {pause:.2f} s"
                + (f" ({reread} tokens read again: the KV type changed)" if reread else ""))
        log.info("band: %s", note)
        if self.on_band is not None:
            self.on_band(Band(target, self.room.seq, round(pause, 3), carried, reread, note))
