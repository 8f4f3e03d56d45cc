"""A loaded model as the scheduler keeps it (`LoadedRunner`): its runner, who uses it and who
waits, when it expires, what it was loaded for and whether it serves a request's options as it
is, and its decode as served against its plan; and the comparisons of loads a re-plan makes.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field

from localllm.engine.runner.load import Load
from localllm.modelstore.shape import ModelShape
from localllm.modelstore.store import ModelEntry
from localllm.options import LoadOptions
from localllm.planner.plan import Plan
from localllm.engine.runner.protocol import Done
from localllm.profiles.served_speed import DecodeCheck, has_host_part

from .starting import RunnerProcess

SERVED_REMEMBERED = 64  # distinct load options a loaded model remembers answering


@dataclass
class LoadedRunner:
    """A loaded model: its runner, who uses it and who waits, and when it expires."""
    runner: RunnerProcess
    entry: ModelEntry
    shape: ModelShape  # read once at load; /api/ps and /api/stats use it
    file_id: tuple  # (inode, size, mtime) of the model file when it was loaded
    load: Load  # the load decision it was started from
    slots: asyncio.Semaphore = field(init=False)
    active: int = 0  # requests holding a slot
    waiting: int = 0  # requests waiting for a slot
    keep_alive: float | None = 300.0  # seconds after the last request; None = forever
    expires_at: float | None = None  # wall-clock time; None while in use or kept forever
    last_used: float = 0.0
    # Whether this load serves a request's load options (Load.serves), decided once per load
    # and options (the load and its runner's plan never change while it is loaded): at load
    # for the options it was loaded for, so the requests that follow, asking the same, find it.
    served: dict[LoadOptions, bool] = field(init=False, default_factory=dict)
    # Why this load should be planned again ("": it serves as planned): its expert pool's
    # measured hit rate is far from the one the plan was priced with. The reaper loads it again
    # once it has been idle Scheduler.replan_idle_s, between requests: a follow-up that comes
    # sooner is answered by the running plan, never made to wait for a new one.
    replan: str = ""
    replan_now: bool = False  # idle long enough: the next _loaded loads it again
    # Its decode as served against the running plan's prediction (profiles/served_speed.py),
    # from answers that had the runner to themselves: `crowded` is set while another request
    # overlapped one since the model was last idle.
    speed: DecodeCheck | None = None
    crowded: bool = False
    # /api/stats' price of the running plan at its pool's measured hits: (plan, pool figures,
    # curve), made again only when the plan (a band switch) or an answer's figures change, not
    # on every poll of a live display. The plan itself, not its id: a freed plan's id returns.
    priced_at_hits: tuple = ()

    def __post_init__(self) -> None:
        self.slots = asyncio.Semaphore(max(1, self.runner.n_parallel))
        self.serves(self.load.asked)

    def serves(self, asked: LoadOptions) -> bool:
        """Whether the loaded model serves a request's load options as it is (Load.serves)."""
        found = self.served.get(asked)
        if found is None:
            if len(self.served) >= SERVED_REMEMBERED:
                self.served.clear()  # clients that vary num_ctx at will: no growing memory
            found = self.served[asked] = self.load.serves(self.runner.plan, asked)
        return found

    @property
    def busy(self) -> bool:
        return self.active > 0

    @property
    def idle(self) -> bool:
        return self.active == 0 and self.waiting == 0

    def check_speed(self, done: Done) -> str:
        """Add an answer's decode to the check against the running plan; why the plan should
        be priced again ("": it should not, or its prices are not the host's to correct: every
        weight on the GPU)."""
        runner = self.runner
        plan = runner.running_plan
        if (self.crowded or runner.cpu_share != 1 or runner.n_threads != plan.n_threads
                or done.drafted is not None):
            return ""  # not the plan's own decode: shared, with fewer threads, or drafted
        if self.speed is None or self.speed.plan.load_key() != plan.load_key():
            self.speed = DecodeCheck(plan)  # a new load, or a fill band's other plan
        self.speed.add(done.prompt_tokens, done.eval_count, done.eval_duration_ns / 1e9)
        if not has_host_part(plan, self.shape.n_layer):
            return ""
        return self.speed.off()


def file_id(path) -> tuple:
    try:
        st = os.stat(path)
    except OSError:
        return ()
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def same_load(a: Load, b: Load) -> bool:
    """Whether two loads start the same runner (their plans' and fill bands' load keys)."""
    return [p.load_key() for p in (a.plan, *a.bands)] == [p.load_key() for p in (b.plan, *b.bands)]


def repriced(decided: Load, running: Plan) -> Plan | None:
    """The plan of `decided` (its whole context's or a fill band's) that the runner runs now."""
    key = running.load_key()
    return next((p for p in (decided.plan, *decided.bands) if p.load_key() == key), None)
