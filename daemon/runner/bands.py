"""Fill bands in the runner: the Engine starts in a small context's plan (the tuner's, for
less KV and more weights on the GPU) and, before a sequence outgrows it, moves to the next
band's: every sequence's state saved to RAM (llama/state.py), the model reloaded with the new
placement, the states restored (a band with another KV type reads them again instead).

One object the runner's Engine (engine.py) holds, because it owns one thing: the switch. It
reloads the model (llama/loaded.py), rebuilds what is bound to it in the slots (the samplers'
grammars), sets the new sizes in the engine's Room and reports the pause (`on_band`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from localllm.llama import state
from localllm.llama.loaded import LoadedModel
from localllm.llama.model import ModelLoadError
from localllm.llama.sampling import Sampler
from localllm.profiles.planning.plan import Plan

from .protocol import Band, Progress
from .slots import Room, Slot

log = logging.getLogger("localllm.runner")


class FillBands:
    def __init__(self, plans: tuple[Plan, ...], start: int, model: LoadedModel,
                 slots: list[Slot], room: Room):
        """`plans`: one per band, smallest context first; the last holds the whole context."""
        self.plans = plans
        self.band = max(0, min(start, len(plans) - 1))
        # In the last band, which holds the whole context: no switch is left to watch for (a
        # load without bands starts there). An attribute the engine reads before each step.
        self.last = self.band == len(plans) - 1
        self.model = model
        self.slots = slots
        self.room = room
        self.pauses: list[float] = []  # seconds each switch stopped decoding
        self.on_band: Callable[[Band], None] | None = None  # after each switch

    @property
    def plan(self) -> Plan:
        """The plan of the band loaded now."""
        return self.plans[self.band]

    def follow(self) -> Plan | None:
        """Move up to the next fill band's plan before a sequence outgrows the loaded one
        (never down: a band stays until the model unloads). The new band's plan, or None
        when the loaded one still holds every sequence."""
        if self.last:
            return None
        need = max((len(s.tokens) + len(s.to_decode) + 1 for s in self.slots if not s.free),
                   default=0)
        if need <= self.room.seq:
            return None
        target = next((i for i in range(self.band + 1, len(self.plans))
                       if self.plans[i].n_ctx >= need), len(self.plans) - 1)
        self._switch(target, need)
        return self.plan

    def _switch(self, target: int, need: int) -> None:
        """Save every sequence's state to RAM, load the target band's plan (the same file,
        another placement and a larger context), restore the states; a sequence whose state
        the new context refuses (another KV type) is read again from its tokens."""
        started = time.perf_counter()
        old, new = self.plans[self.band], self.plans[target]
        why = (f"a sequence needs {need} tokens, the {old.n_ctx}-token band holds "
               f"{self.room.seq}: moving to the {new.n_ctx}-token band's plan")
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
            self.plans = self.plans[:self.band + 1]
            target, new = self.band, old
            why = f"{why} failed (out of memory?); stayed in the {old.n_ctx}-token band"
        self.band = target
        self.last = self.band == len(self.plans) - 1
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
            work.sampler = Sampler(self.model.lm.vocab, self.model.lm.n_vocab,
                                   work.request.options, work.request.grammar, work.prompt,
                                   self.room.n_ctx)
            for token in work.answer:  # the grammar's state and the penalties' history
                work.sampler.accept(token)
        pause = time.perf_counter() - started
        self.pauses.append(pause)
        note = (f"{why}; reloaded and carried {carried} sequences over in {pause:.2f} s"
                + (f" ({reread} tokens read again: the KV type changed)" if reread else ""))
        log.info("band: %s", note)
        if self.on_band is not None:
            self.on_band(Band(target, self.room.seq, round(pause, 3), carried, reread, note))
