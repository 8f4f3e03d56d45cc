"""A user's session against a real daemon on a GPU, step by step, for the GPU suite.

The daemon runs one synthetic model (scripts/synth_gguf.py: the real tensor table, random
weights) on an emulated card budget: `LOCALLLM_VRAM_MARGIN_MIB` = free VRAM less the budget, so
the planner sees a 6, 12 or 24 GiB card on the big one. Each step is one thing a user does
(short prompts, a long prompt that moves the runner into the next fill band, follow-ups on
that prefix, a new chat, concurrent requests, a stream cut mid-way, an unload and reload);
every step records what came back, the runner's pid before and after, and the card's peak
memory, so a test can assert that nothing died and nothing went unanswered.

    python3 -m tests.gpu.session --shape qwen3-30b-a3b --budget 12 --steps crash --out $OUT

runs one session outside pytest (the device's first look at a crash).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]



MIB = 1 << 20
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa",
         "lambda", "mu", "nu", "xi", "omicron", "pi", "rho", "sigma", "tau", "upsilon", "phi",
         "chi", "psi", "omega"]


def text_of(n_words: int, seed: int) -> str:
    """Text that does not repeat in short spans (a prompt the prefix cache cannot fake)."""
    return " ".join(WORDS[(seed * 7 + i * 3 + i // 24) % len(WORDS)] for i in range(n_words))


class Card:
    """The GPU's memory through NVML: free now, and the peak used while sampling."""

    def __init__(self):
        self.handle = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception:  # no GPU (a dry run of the script on a CPU): memory reads as 0
            pass
        self.peak = 0
        self.step_peak = 0  # since the last mark(): a step's own peak
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def used(self) -> int:
        return int(self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used) if self.handle else 0

    def free(self) -> int:
        return int(self.nvml.nvmlDeviceGetMemoryInfo(self.handle).free) if self.handle else 0

    def start(self) -> None:
        self.peak = self.used()
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def mark(self) -> None:
        self.step_peak = self.used()

    def _sample(self) -> None:
        while not self._stop.is_set():
            used = self.used()
            self.peak = max(self.peak, used)
            self.step_peak = max(self.step_peak, used)
            self._stop.wait(0.05)

    def stop(self) -> int:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return self.peak


@dataclass
class Answer:
    status: int
    text: str = ""
    error: str = ""
    eval_count: int = 0
    prompt_eval_count: int = 0
    cached: int = 0
    decode_tps: float = 0.0
    events: int = 0


@dataclass
class Step:
    name: str
    answers: list[Answer] = field(default_factory=list)
    runner_before: int | None = None
    runner_after: int | None = None
    seconds: float = 0.0
    note: str = ""
    peak_mib: int = 0  # the card's peak so far above the baseline (sampling: Card.start)
    # this step's own peak and what stays used after it: a transient peak (a reload, a pass's
    # temporaries) against lasting growth (pools that never give memory back)
    step_peak_mib: int = 0
    after_mib: int = 0
    # what the daemon planned for the VRAM after the step (/api/ps: size_vram and the device
    # split), beside the measured peak: where the planner's memory model is off
    planned_vram_mib: int = 0
    devices: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(a.status == 200 and not a.error for a in self.answers)


class Session:
    """One daemon, one model, the steps a user takes."""

    def __init__(self, model_path: Path, budget_gib: float, tmp: Path, ctx: int = 32768,
                 **settings: str):
        from tests.daemon_process import isolated_env, start_daemon

        from localllm.modelstore.store import ModelStore

        self.card = Card()
        self.budget_mib = int(budget_gib * 1024)
        self.baseline = self.card.used()
        margin = max(0, self.card.free() // MIB - self.budget_mib)
        env = isolated_env(tmp, **{"LOCALLLM_CONTEXT_LENGTH": str(ctx),
                                   "LOCALLLM_VRAM_MARGIN_MIB": str(margin), **settings})
        os.chmod(model_path, 0o600)  # private: the store links it, no copy of a big file
        ModelStore(Path(env["XDG_DATA_HOME"]) / "localllm" / "models").import_gguf(
            model_path, "m")
        self.log = Path(env["XDG_STATE_HOME"]) / "localllm" / "logs" / "localllm.log"
        self.daemon = start_daemon(env, timeout=120)
        self.url = self.daemon.url
        self.ctx = ctx
        self.steps: list[Step] = []

    # ---- requests ---------------------------------------------------------------------
    def generate(self, prompt: str, n: int, *, cut_after: int = 0, raw: bool = True,
                 **options) -> Answer:
        """One streamed /api/generate, greedy; `cut_after` tokens: the client hangs up."""
        body = {"model": "m", "prompt": prompt, "raw": raw, "stream": True,
                "options": {"num_predict": n, "temperature": 0, "seed": 1,
                            "speculative": "off", **options}}
        req = urllib.request.Request(self.url + "/api/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        answer = Answer(status=0)
        text = []
        try:
            with urllib.request.urlopen(req, timeout=900) as resp:
                answer.status = resp.status
                for line in resp:
                    chunk = json.loads(line)
                    answer.events += 1
                    if chunk.get("error"):
                        answer.error = chunk["error"]
                        break
                    text.append(chunk.get("response", ""))
                    if chunk.get("done"):
                        answer.eval_count = chunk.get("eval_count", 0)
                        answer.prompt_eval_count = chunk.get("prompt_eval_count", 0)
                        answer.cached = chunk.get("prompt_eval_cached_count", 0)
                        if chunk.get("eval_duration"):
                            answer.decode_tps = answer.eval_count / (chunk["eval_duration"] / 1e9)
                        break
                    if cut_after and answer.events >= cut_after:
                        break  # the client hangs up mid-stream
        except urllib.error.HTTPError as e:
            answer.status = e.code
            answer.error = e.read().decode(errors="replace")
        except OSError as e:
            answer.error = f"{type(e).__name__}: {e}"
        answer.text = "".join(text)
        return answer

    def runner_pid(self) -> int | None:
        """The runner process of the loaded model, as /api/ps reports it (None: unloaded)."""
        models = self.daemon.ps()
        return models[0]["runner_pid"] if models else None

    def step(self, name: str, fn, note: str = "") -> Step:
        s = Step(name, note=note, runner_before=self.runner_pid())
        self.card.mark()
        started = time.perf_counter()
        result = fn()
        s.answers = result if isinstance(result, list) else [result]
        s.seconds = round(time.perf_counter() - started, 2)
        s.runner_after = self.runner_pid()
        loaded = self.daemon.ps()
        if loaded:
            s.planned_vram_mib = loaded[0].get("size_vram", 0) // MIB
            s.devices = loaded[0].get("devices", [])
        s.peak_mib = (self.card.peak - self.baseline) // MIB
        s.step_peak_mib = (self.card.step_peak - self.baseline) // MIB
        s.after_mib = (self.card.used() - self.baseline) // MIB
        self.steps.append(s)
        print(f"  {name}: {'ok' if s.ok else 'FAILED'} in {s.seconds} s, peak {s.peak_mib} MiB "
              f"(planned {s.planned_vram_mib}; this step {s.step_peak_mib}, after it "
              f"{s.after_mib}), "
              f"runner "
              f"{s.runner_before} -> {s.runner_after}; "
              + "; ".join(f"{a.status} {a.eval_count} tok {a.decode_tps:.1f} tok/s "
                          f"read {a.prompt_eval_count - a.cached}"
                          + (f" error {a.error[:200]}" if a.error else "") for a in s.answers),
              flush=True)
        return s

    def unload(self) -> None:
        body = json.dumps({"model": "m", "keep_alive": 0}).encode()
        req = urllib.request.Request(self.url + "/api/generate", data=body,
                                     headers={"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=120).read()
        deadline = time.monotonic() + 60
        while self.daemon.ps() and time.monotonic() < deadline:
            time.sleep(0.1)  # ok-sleep: the poll interval of a deadline loop

    def log_tail(self, n: int = 80) -> str:
        """The last `n` lines of the daemon's log and of each runner's log."""
        parts = []
        for path in sorted(self.log.parent.glob("*.log")):
            try:
                lines = path.read_text(errors="replace").splitlines()[-n:]
            except OSError:
                continue
            parts.append(f"==> {path.name} <==\n" + "\n".join(lines))
        return "\n".join(parts)

    def buffer_lines(self) -> str:
        """Every line of the runners' logs where llama.cpp says what it allocated (the model,
        KV, compute and pool buffers), from the whole log: these come at each load."""
        keep = re.compile(r"buffer size|KV self|compute buffer|expert|pool|graph_reserve|CUDA0")
        parts = []
        for path in sorted(self.log.parent.glob("*.log")):
            if path.name == self.log.name:
                continue
            try:
                lines = path.read_text(errors="replace").splitlines()
            except OSError:
                continue
            parts.append(f"==> {path.name} (allocations) <==\n"
                         + "\n".join(ln for ln in lines if keep.search(ln)))
        return "\n".join(parts)

    def stop(self) -> None:
        self.daemon.stop()


# ---- the steps ------------------------------------------------------------------------
LONG_TOKENS = 16000  # past the 8K band, inside 32K: the runner moves into the next band


def crash_sequence(s: Session, long_tokens: int = LONG_TOKENS) -> str:
    """The order that killed the runner on Qwen3-30B-A3B: short answers, a long prompt that
    moves the runner into the next band, then that prompt again with four more words. The
    long prompt's length is measured in the model's tokens (the first short prompt's count
    gives the words per token). Returns the long prompt."""
    short = text_of(40, 1)
    first = s.step("short 1", lambda: s.generate(short, 96)).answers[0]
    for i in (2, 3):
        s.step(f"short {i}", lambda: s.generate(short, 96))
    words = int(long_tokens * 40 / max(1, first.prompt_eval_count))
    long = text_of(words, 2)
    s.step("long prompt", lambda: s.generate(long, 16), note="crosses into the next band")
    s.step("follow-up", lambda: s.generate(long + " and four more words", 8))
    return long


def full_session(s: Session, long_tokens: int = LONG_TOKENS) -> None:
    """Every moment of a session the GPU suite covers."""
    long = crash_sequence(s, long_tokens)
    s.step("second follow-up", lambda: s.generate(long + " and four more words, then five", 24))
    s.step("new short chat", lambda: s.generate(text_of(30, 3), 48))
    answers: list[Answer] = []

    def concurrent() -> list[Answer]:
        threads = [threading.Thread(target=lambda i=i: answers.append(
            s.generate(text_of(30, 10 + i), 48))) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return answers

    s.step("4 concurrent", concurrent)
    s.step("cancelled stream", lambda: s.generate(text_of(30, 20), 400, cut_after=8))
    s.step("after cancel", lambda: s.generate(text_of(30, 21), 32))

    def reload() -> Answer:
        s.unload()
        return s.generate(text_of(40, 1), 32)

    s.step("unload and reload", reload)


def common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def run_one(model: Path, args, settings: dict[str, str], tag: str) -> tuple[Session, int]:
    """A session's steps on a daemon of its own; the session and the card's peak above the
    baseline (MiB)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        s = Session(model, args.budget, Path(tmp), **settings)
        s.card.start()
        try:
            (crash_sequence if args.steps == "crash" else full_session)(s, args.long_tokens)
        finally:
            peak = s.card.stop()
            tail = s.buffer_lines() + "\n" + s.log_tail(200)
            s.stop()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"session-{args.shape}-{args.budget:g}g{tag}"
    (out / f"{name}.log").write_text(tail)
    peak_mib = (peak - s.baseline) // MIB
    with open(out / "sessions.jsonl", "a") as f:
        f.write(json.dumps({"shape": args.shape, "budget_gib": args.budget, "tag": tag,
                            "settings": settings, "peak_mib": peak_mib,
                            "steps": [{**asdict(st), "ok": st.ok} for st in s.steps]}) + "\n")
    return s, peak_mib


def main(argv: list[str] | None = None) -> int:
    from scripts import synth_gguf

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--routing", default="zipf:0.3")
    p.add_argument("--budget", type=float, default=12)
    p.add_argument("--steps", choices=("crash", "full"), default="crash")
    p.add_argument("--models", default="/tmp/models")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--tag", default="")
    p.add_argument("--tiny", action="store_true", help="toy dimensions (a dry run on a CPU)")
    p.add_argument("--long-tokens", type=int, default=LONG_TOKENS)
    p.add_argument("--compare", action="store_true",
                   help="run the steps again with the expert cache off and compare the answers")
    p.add_argument("--set", action="append", default=[], metavar="VAR=VALUE",
                   help="a daemon setting (LOCALLLM_EXPERT_MISSES=cpu ...)")
    args = p.parse_args(argv)
    config = synth_gguf.SHAPES[args.shape]
    model = synth_gguf.ensure_model(Path(args.models),
                                    synth_gguf.tiny(config) if args.tiny else config,
                                    routing=args.routing)
    settings = dict(kv.split("=", 1) for kv in args.set)
    s, peak = run_one(model, args, settings, args.tag)
    failed = [st.name for st in s.steps if not st.ok or (
        st.runner_before not in (None, st.runner_after) and st.name != "unload and reload")]
    print(f"{args.shape} at {args.budget:g} GiB{args.tag}: peak {peak} MiB of {s.budget_mib}; "
          + (f"FAILED or runner changed: {failed}" if failed else "every step answered"),
          flush=True)
    if args.compare:  # the same steps with the expert cache off: greedy answers compared
        off, _ = run_one(model, args, {**settings, "LOCALLLM_EXPERT_CACHE": "off"},
                         args.tag + "-off")
        for a, b in zip(s.steps, off.steps, strict=False):
            for x, y in zip(a.answers, b.answers, strict=False):
                same = x.text == y.text
                print(f"  {a.name}: {'same' if same else 'DIFFERENT'} "
                      f"({common_prefix(x.text, y.text)} of {len(x.text)}/{len(y.text)} "
                      f"characters agree)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
