"""The two systems a session benchmark drives on one emulated VRAM budget, each with
`generate(prompt, n)` giving the same figures: `Ours`, the localllm daemon with the model
imported into a private store (vram_margin_mib = free - budget + margin), and `Fit`,
`llama-server --fit on --fit-target (free - budget)`. Used by bench_session.py and the
benchmarks built on it (bench_past_ram.py, bench_two_gpus.py, bench_replay.py,
bench_baseline.py).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


import llama_cpp  # noqa: E402, F401  (a CUDA build must load before numpy)

from localllm.engine.model import GROUPED_ATTENTION, GROUPED_ATTENTION_MAX_HEAD  # noqa: E402
from scripts import synth_gguf  # noqa: E402
from scripts.bench.bench_tuner import MemorySampler  # noqa: E402

MIB = 1 << 20


def attention_kernel(shape: str) -> str:
    """Which one-token attention kernel ours runs over a quantized cache of a synthetic shape:
    "grouped" (patch 0007, query heads of one KV head a block: the runner's choice for heads up
    to 128 wide, engine/model.py choose_grouped_attention, or as LOCALLLM_FA_VEC_GQA says) or
    "per-head" (the kernel before it)."""
    patched = (ROOT / "patches" / "0007-fattn-vec-gqa-heads.patch").exists()
    asked = os.environ.get(GROUPED_ATTENTION)
    config = synth_gguf.SHAPES.get(shape)
    if asked is None:
        grouped = config is not None and config.head_dim <= GROUPED_ATTENTION_MAX_HEAD
    else:
        grouped = asked != "0"
    return "grouped" if patched and grouped else "per-head"


def keep_daemon_logs(tmp: Path, dest: Path) -> None:
    """Copy the logs of ours' daemon and runners (its state folder under `tmp`, Ours's) to
    `dest`, where there are any: a run's temporary folder goes when it ends."""
    logs = Path(tmp) / "xdg_state_home" / "localllm" / "logs"
    if logs.is_dir():
        shutil.copytree(logs, dest, dirs_exist_ok=True)


def with_kernel(row: dict) -> dict:
    """A row of ours tagged with the attention kernel it ran, so that a repricing prices each
    run with its own (scripts/bench/reprice_runs.py); other systems' rows as they are."""
    if str(row.get("system", "")).startswith("ours"):
        return {**row, "attention": attention_kernel(str(row.get("shape", "")))}
    return row


def post(url: str, body: dict, timeout: float = 900) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def daemon_settings(harness: dict[str, str], system: dict[str, str]) -> dict[str, str]:
    """Our daemon's settings: those exported to the benchmark's command (`LOCALLLM_KV_CACHE_TYPE
    =f16 python -m ...`; isolated_env makes the environment anew without the caller's: lease G
    ran its "f16" line on q8_0), then the harness's own (its context, margin, bands), then the
    system's (`ours-cache`'s pool)."""
    from localllm.config import ENV

    exported = {env: os.environ[env] for env in ENV.values()
                if env in os.environ and env != "LOCALLLM_HOST"}  # isolated_env's own port
    passed = {k: v for k, v in exported.items() if k not in harness and k not in system}
    if passed:
        print(f"ours' daemon gets {passed}", flush=True)
    return exported | harness | system


class Ours:
    """The daemon, one model loaded at the context asked, streaming /api/generate (raw)."""

    name = "ours"

    def __init__(self, model: Path, ctx: int, budget_mib: int, margin_mib: int, workload: str,
                 tmp: Path, fill_bands: str = "auto", learned: Path | None = None,
                 options: dict | None = None, **settings: str):
        """`learned`: a folder that keeps what the daemon learns on this machine (its profiles
        folder: the ways measured, the pool's hits, the prices served) from one start to the
        next, as a user's config folder does; None: each start learns from nothing.
        `options`: more of every request's options (num_thread)."""
        self.options = dict(options or {})
        from tests.daemon_process import isolated_env, start_daemon

        from localllm.modelstore.store import ModelStore

        free = MemorySampler().free() // MIB
        margin = max(0, free - budget_mib + margin_mib) if free else 0
        env = isolated_env(tmp, **daemon_settings(dict(
            LOCALLLM_NUM_PARALLEL="1", LOCALLLM_CONTEXT_POLICY="fixed",
            LOCALLLM_CONTEXT_LENGTH=str(ctx), LOCALLLM_WORKLOAD=workload,
            LOCALLLM_VRAM_MARGIN_MIB=str(margin), LOCALLLM_FILL_BANDS=fill_bands), settings))
        # The benchmark's own file, made private so that the import links it: a copy of a
        # 37 GiB model beside the others filled the GPU machine's 64 GiB disk.
        os.chmod(model, 0o600)
        ModelStore(Path(env["XDG_DATA_HOME"]) / "localllm" / "models").import_gguf(model, "bench")
        if os.environ.get("BENCH_DRAFTS", "unaccepted") == "unaccepted":
            never_accepted(model, env)
        self.profiles = Path(env["XDG_CONFIG_HOME"]) / "localllm" / "profiles"
        self.learned = learned
        if learned is not None and learned.is_dir():
            shutil.copytree(learned, self.profiles, dirs_exist_ok=True)
        self.daemon = start_daemon(env)
        self.url = self.daemon.url
        self.ctx = ctx

    def generate(self, prompt: str, n: int) -> dict:
        """{ttft, decode_tps, prompt_tokens, text} of one streamed raw generation."""
        body = json.dumps({"model": "bench", "prompt": prompt, "raw": True, "stream": True,
                           "options": {"num_predict": n, "temperature": 0, "seed": 1,
                                       "speculative": "off", "num_ctx": self.ctx,
                                       **self.options}})
        req = urllib.request.Request(self.url + "/api/generate", data=body.encode(),
                                     headers={"Content-Type": "application/json"})
        start = time.perf_counter()
        first = last = 0.0
        count, text, done = 0, [], {}
        with urllib.request.urlopen(req, timeout=1800) as resp:
            for line in resp:
                chunk = json.loads(line)
                if chunk.get("done"):
                    done = chunk
                    break
                if chunk.get("response"):
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    count += 1
                    text.append(chunk["response"])
        decode = (count - 1) / (last - first) if count > 1 and last > first else 0.0
        if done.get("eval_count") and done.get("eval_duration"):  # the daemon's own timing
            decode = done["eval_count"] / (done["eval_duration"] / 1e9)
        # this request's: the whole prompt and where its cache came from
        last = self._model("/api/stats").get("last") or {}
        return {"ttft": first - start if first else 0.0, "decode_tps": decode,
                "answer_tokens": done.get("eval_count", count),
                "prompt_tokens": done.get("prompt_eval_count", 0), "text": "".join(text),
                "prompt_total": last.get("prompt_tokens", 0),
                # prompt_eval_count is the whole input, as Ollama counts it; the cached part
                # beside it was not read
                "read": done.get("prompt_eval_count", 0) - done.get("prompt_eval_cached_count", 0),
                "cached_from": last.get("cached_from"), "checkpoint": last.get("checkpoint")}

    def _model(self, endpoint: str) -> dict:
        """The loaded model's entry in /api/ps or /api/stats ({} when none is loaded)."""
        [m] = self.daemon.get(endpoint)["models"] or [{}]
        return m

    def plan(self) -> str:
        m = self._model("/api/ps")
        keys = ("gpu_layers", "kv_type", "context_length", "processor", "fill_band",
                "workload")
        return ", ".join(f"{k} {m.get(k)}" for k in keys if k in m)

    def predicted(self, depth: int) -> float | None:
        """The running plan's predicted decode (tok/s) at `depth` tokens of context, read off its
        curve (start, middle, end) by straight lines: what issue 37 holds the measurement to."""
        plan = self._model("/api/stats").get("plan") or {}
        return at_depth(plan.get("predicted_decode_by_depth"), depth)

    def curve_at_hits(self) -> list | None:
        """The plan's decode by depth priced at its expert pool's hit rate measured so far
        (/api/stats; None before the pool has enough lookups)."""
        return (self._model("/api/stats").get("expert_cache") or {}).get(
            "predicted_decode_by_depth")

    def running(self) -> dict:
        """What the run ran on: the running plan's placement, KV type, context and threads (a
        fill band's plan once the runner moved into it), for scripts/bench/reprice_runs.py."""
        plan = self._model("/api/stats").get("plan") or {}
        return {k: plan[k] for k in ("gpu_layers", "kv_type", "n_ctx", "n_threads",
                                     "cpu_overrides") if k in plan}

    def expert_cache(self) -> dict | None:
        """The MoE expert cache's slots, hits and misses so far (/api/stats; None: off)."""
        return self._model("/api/stats").get("expert_cache")

    def settling(self) -> dict:
        """What ps says of the plan's settling: the ways `auto` weighed (priced, measured),
        the decode check, and the re-plan due once idle (absent when none is)."""
        m = self._model("/api/ps")
        return {k: m[k] for k in ("ways", "decode", "replan") if k in m}

    def band(self) -> dict | None:
        """The fill band the runner is in and the pauses of its switches (ps)."""
        return self._model("/api/ps").get("fill_band")

    def stop(self) -> None:
        self.daemon.stop()  # (the tuner's records are written before it exits)
        if self.learned is not None and self.profiles.is_dir():
            shutil.copytree(self.profiles, self.learned, dirs_exist_ok=True)


def never_accepted(model: Path, env: dict) -> None:
    """Tell the tuner what the daemon would measure of this model's drafts: random weights
    draft tokens the model never picks. Without it, a model with MTP heads is planned for
    drafting at the assumed 70% acceptance (VRAM for the NextN block, its KV, a pool priced
    with the drafts' speed), and the bench, which asks every request with `speculative: off`
    to compare plain decode with llama-server's, measures a plan made for something else. The
    record is the one `ServedRecords.drafted` writes after MIN_DRAFTED drafted tokens
    (localllm/profiles/acceptance.py). BENCH_DRAFTS=assumed leaves it out."""
    from localllm.profiles.acceptance import MIN_DRAFTED, record
    from localllm.speculative import DRAFTING_MODES

    config_dir = Path(env["XDG_CONFIG_HOME"]) / "localllm" / "profiles"
    for mode in DRAFTING_MODES:
        record("bench:latest", model.stat().st_size, mode, MIN_DRAFTED * 4, 0,
               path=config_dir / "acceptance.toml")


def wait_healthy(proc: subprocess.Popen, url: str, log, timeout: float) -> None:
    """Until llama-server answers /health (RuntimeError if it exits or the time runs out)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited {proc.returncode} (see {log})")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError("llama-server did not start")


class Fit:
    """llama-server with llama.cpp's own fitting for the same budget, /completion streamed."""

    def __init__(self, model: Path, ctx: int, budget_mib: int, kv: str, threads: int,
                 log: Path, *, binary: str = "llama-server", extra: tuple[str, ...] = (),
                 reserve_mib: int = 0, name: str = ""):
        """`threads` 0: llama.cpp's own default; `extra` arguments after the common ones;
        `reserve_mib` more left free by --fit (memory the server takes after fitting, such as
        --moe-cache-mib, which fitting does not count)."""
        self.name = name or f"fit-{kv}"
        free = MemorySampler().free() // MIB
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [binary, "-m", str(model), "-c", str(ctx), "--fit", "on", "--fit-target",
               str(max(0, free - budget_mib + reserve_mib)),
               *(["-t", str(threads)] if threads > 0 else []), "-np", "1", "-fa", "on",
               "-ctk", kv, "-ctv", kv, "--port", str(port), "--host", "127.0.0.1", *extra]
        self.log = open(log, "w")  # noqa: SIM115 (closed in stop(), after the server)
        env = dict(os.environ)
        if os.sep in binary:  # a build of its own: its libraries, not those on the path before
            env["LD_LIBRARY_PATH"] = os.pathsep.join(
                p for p in (str(Path(binary).parent), env.get("LD_LIBRARY_PATH")) if p)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True, env=env)
        self.url = f"http://127.0.0.1:{port}"
        wait_healthy(self.proc, self.url, log, 600)

    def generate(self, prompt: str, n: int) -> dict:
        start = time.perf_counter()
        out = post(self.url + "/completion", {"prompt": prompt, "n_predict": n,
                                              "temperature": 0, "cache_prompt": True,
                                              "ignore_eos": True})
        wall = time.perf_counter() - start
        t = out.get("timings", {})
        per_token = t.get("predicted_ms", 0) / max(1, t.get("predicted_n", 1))
        return {"ttft": max(0.0, wall - t.get("predicted_ms", 0) / 1000 + per_token / 1000),
                "decode_tps": t.get("predicted_per_second", 0.0),
                "answer_tokens": t.get("predicted_n", 0),
                "prompt_tokens": t.get("prompt_n", 0) + t.get("cache_n", 0),
                "text": out.get("content", ""),
                "prompt_total": t.get("prompt_n", 0) + t.get("cache_n", 0),
                "read": t.get("prompt_n", 0)}

    def band(self) -> None:
        return None

    def plan(self) -> str:
        return "llama-server --fit"

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def at_depth(curve, depth: int) -> float | None:
    """A (depth, tok/s) curve read at `depth` by straight lines; None for no curve."""
    curve = sorted(curve or [])
    if not curve:
        return None
    for (d0, t0), (d1, t1) in zip(curve, curve[1:], strict=False):
        if depth <= d1:
            f = 0.0 if d1 == d0 else max(0.0, (depth - d0) / (d1 - d0))
            return round(t0 + f * (t1 - t0), 2)
    return round(curve[-1][1], 2)
