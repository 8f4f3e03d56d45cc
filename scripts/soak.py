"""Soak a localllm daemon on this machine: many clients, mixed requests, runner kills; then
check that it held. Bounded in time and in requests; loopback only (it kills runner pids).

    .venv/bin/python -m scripts.soak --spawn --clients 64 --duration 120 --kill-every 20

--spawn starts `localllm serve` on a free loopback port with this environment (its store and
config: point LOCALLLM_MODELS or XDG_DATA_HOME elsewhere to soak a scratch store) and stops it
at the end; --url soaks a daemon that is already running (on 127.0.0.1 / ::1 / localhost).

Each client loops until the time or the request budget runs out, picking one of: chat and
generate (Ollama), chat completions (OpenAI), embeddings (only where the daemon has a route for
them: probed first), each streaming or not; a cancel (a stream dropped after its first chunk);
a malformed request (which must get a 4xx). A killer SIGKILLs the runner pids /api/ps names
every K seconds. Every request has a deadline; one that passes it is counted as hung.

At the end it prints requests sent, answered, rejected with 503, failed (with reasons),
latency percentiles, hung, whether the daemon is still up, and whether every blob in the store
still matches its sha256; as JSON too, to $OUT/soak.json when OUT is set. Exit status 1 when
something broke a rule: a hang, a 5xx other than 503, traceback text in an answer, a malformed
request accepted, a stream cut with neither its last chunk nor an error line, the daemon down,
or a blob that does not verify.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import hashlib
import ipaddress
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
from localllm.client import serve_command

PROMPTS = ["Write a haiku about rain.", "What is 2 + 2?", "Name three colours.",
           "Tell me a short story about a fox.", "Explain gravity in one sentence.",
           "List the days of the week.", "Why is the sky blue?", "Say hello in French."]

# Bodies a daemon must refuse with a 4xx: (label, routes, raw bytes or a JSON-able body). Each
# is wrong for the routes it is sent to (generate ignores `messages`, chat ignores `prompt`).
ALL = ("/api/chat", "/api/generate", "/v1/chat/completions")
MALFORMED: list[tuple[str, tuple[str, ...], object]] = [
    ("invalid json", ALL, b'{"model": "MODEL", "messages": ['),
    ("lone surrogate", ALL,
     b'{"model": "MODEL", "prompt": "\\ud800", "messages": [{"role": "user", '
     b'"content": "\\ud800"}]}'),
    ("not an object", ALL, [1, 2, 3]),
    ("unknown model", ALL, {"model": "no-such-model-soak", "prompt": "hi",
                            "messages": [{"role": "user", "content": "hi"}]}),
    ("bad name", ALL, {"model": "../../etc/passwd", "prompt": "hi"}),
    ("wrong type", ("/api/generate",), {"model": "MODEL", "prompt": 42}),
    ("bad options", ("/api/chat", "/api/generate"),
     {"model": "MODEL", "prompt": "hi", "options": {"temperature": "hot"},
      "messages": [{"role": "user", "content": "hi"}]}),
    ("bad messages", ("/api/chat", "/v1/chat/completions"),
     {"model": "MODEL", "messages": [{"role": "wizard", "content": "x"}]}),
    ("NaN", ALL, b'{"model": "MODEL", "prompt": "hi", "options": {"top_p": NaN}}'),
]


@dataclass
class Tally:
    sent: int = 0
    answered: int = 0
    rejected_503: int = 0
    rejected_503_without_retry_after: int = 0
    refused_as_expected: int = 0  # malformed requests that got their 4xx
    cancelled: int = 0  # streams this script dropped on purpose
    hung: int = 0
    failures: collections.Counter = field(default_factory=collections.Counter)
    by_kind: collections.Counter = field(default_factory=collections.Counter)
    latencies: list[float] = field(default_factory=list)  # seconds, answered requests
    first_token: list[float] = field(default_factory=list)  # seconds, answered streams
    tokens: int = 0  # eval_count of answered Ollama requests
    kills: int = 0
    tracebacks: int = 0
    streams_ended_by_error: int = 0  # a stream whose last line is an error (a killed runner)
    streams_cut_silently: int = 0  # a stream that stopped with neither its end nor an error

    def fail(self, reason: str) -> None:
        self.failures[reason] += 1

    @property
    def failed(self) -> int:
        return sum(self.failures.values())


class Broke(Exception):
    """A response that breaks a rule; the message is the reason counted."""


def loopback_only(url: str) -> None:
    host = urlsplit(url).hostname or ""
    try:
        ok = ipaddress.ip_address(host).is_loopback
    except ValueError:
        ok = host == "localhost"
    if not ok:
        raise SystemExit(f"soak.py only runs against this machine (loopback), not {host!r}")


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def pick(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)
    return {"p50": pick(0.50), "p90": pick(0.90), "p99": pick(0.99), "max": round(ordered[-1], 3)}


class Soak:
    def __init__(self, url: str, model: str, args: argparse.Namespace, api_key: str = ""):
        self.url, self.model, self.args = url.rstrip("/"), model, args
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.tally = Tally()
        self.deadline = time.monotonic() + args.duration
        self.budget = args.max_requests
        self.has_embed: str | None = None
        self.rng = random.Random(args.seed)

    # ---- the plan ---------------------------------------------------------------------
    def kinds(self) -> list[tuple[str, float]]:
        kinds = [("chat", 3), ("chat-stream", 3), ("generate", 2), ("generate-stream", 2),
                 ("openai-chat", 1), ("openai-chat-stream", 1), ("cancel", 1.5),
                 ("malformed", 1.5)]
        if self.has_embed:
            kinds.append(("embed", 1))
        return kinds

    def take(self) -> bool:
        if time.monotonic() >= self.deadline or self.budget <= 0:
            return False
        self.budget -= 1
        return True

    async def probe_embed(self, session: aiohttp.ClientSession) -> None:
        for path in ("/api/embed", "/v1/embeddings"):
            async with session.post(self.url + path, json={}) as response:
                if response.status != 404:
                    self.has_embed = path
                    return

    # ---- requests ---------------------------------------------------------------------
    def options(self) -> dict:
        return {"num_predict": self.rng.randint(4, self.args.max_tokens),
                "temperature": round(self.rng.uniform(0, 1), 2)}

    def body(self, kind: str) -> tuple[str, object]:
        prompt = self.rng.choice(PROMPTS)
        stream = kind.endswith("-stream") or kind == "cancel"
        if kind.startswith("chat") or kind == "cancel":
            return "/api/chat", {"model": self.model, "stream": stream, "options": self.options(),
                                 "messages": [{"role": "user", "content": prompt}]}
        if kind.startswith("generate"):
            return "/api/generate", {"model": self.model, "prompt": prompt, "stream": stream,
                                     "options": self.options()}
        if kind.startswith("openai-chat"):
            return "/v1/chat/completions", {
                "model": self.model, "stream": stream, "max_tokens": self.options()["num_predict"],
                "messages": [{"role": "user", "content": prompt}]}
        if kind == "embed":
            return self.has_embed, {"model": self.model, "input": prompt}
        label, routes, raw = self.rng.choice(MALFORMED)
        path = self.rng.choice(routes)
        if isinstance(raw, bytes):
            return path, raw.replace(b"MODEL", self.model.encode())
        return path, json.loads(json.dumps(raw).replace("MODEL", self.model))

    async def one(self, session: aiohttp.ClientSession, kind: str) -> float:
        """Send one request and count its outcome; returns how long to back off (after a 503:
        its Retry-After, or a second where it gives none, as a polite client would)."""
        path, body = self.body(kind)
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        started = time.monotonic()
        async with session.post(self.url + path, data=data,
                                headers={"Content-Type": "application/json"}) as response:
            if response.status == 503:
                self.tally.rejected_503 += 1
                retry_after = response.headers.get("Retry-After", "")
                if not retry_after:
                    self.tally.rejected_503_without_retry_after += 1
                await self.read_error(response)
                return float(retry_after) if retry_after.isdigit() else 1.0
            if kind == "malformed":
                text = await self.read_error(response)
                if 400 <= response.status < 500:
                    self.tally.refused_as_expected += 1
                    return 0.0
                raise Broke(f"malformed request answered {response.status}: {text[:80]}")
            if response.status != 200:
                text = await self.read_error(response)
                raise Broke(f"HTTP {response.status} on {path}: {text[:120]}")
            # Embeddings answer one JSON object and take no `stream`; every other kind says.
            streamed = kind != "embed" and body.get("stream", True)
            if not streamed:
                text = await response.text()
                self.check_text(text)
                reply = json.loads(text)
                self.tally.tokens += int(reply.get("eval_count") or 0)
            else:
                await self.read_stream(response, path, kind, started)
                if kind == "cancel":
                    return 0.0
        self.tally.answered += 1
        self.tally.latencies.append(time.monotonic() - started)
        return 0.0

    async def read_stream(self, response: aiohttp.ClientResponse, path: str, kind: str,
                          started: float) -> None:
        first = True
        done = False
        async for raw in response.content:
            line = raw.decode("utf-8", "replace").strip()
            if not line:
                continue
            self.check_text(line)
            if first:
                first = False
                if kind == "cancel":  # drop the connection mid-answer
                    response.close()
                    self.tally.cancelled += 1
                    return
                self.tally.first_token.append(time.monotonic() - started)
            if path.startswith("/v1/"):
                if not line.startswith("data:"):
                    continue  # SSE comments (`: prompt N/M` while a long prompt is read), events
                payload = line.removeprefix("data:").strip()
                if payload == "[DONE]":
                    done = True
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    self.tally.streams_ended_by_error += 1
                    raise Broke(f"error in stream: {_short(chunk['error'])}")
                continue
            chunk = json.loads(line)
            if "error" in chunk:
                self.tally.streams_ended_by_error += 1
                raise Broke(f"error in stream: {_short(chunk['error'])}")
            if chunk.get("done"):
                self.tally.tokens += int(chunk.get("eval_count") or 0)
                done = True
        if not done:
            self.tally.streams_cut_silently += 1
            raise Broke("stream ended without its last chunk")

    async def read_error(self, response: aiohttp.ClientResponse) -> str:
        text = await response.text()
        self.check_text(text)
        return text

    def check_text(self, text: str) -> None:
        if "Traceback (most recent call last)" in text:
            self.tally.tracebacks += 1

    async def client(self, session: aiohttp.ClientSession) -> None:
        kinds = self.kinds()
        names, weights = [k for k, _ in kinds], [w for _, w in kinds]
        while self.take():
            kind = self.rng.choices(names, weights)[0]
            self.tally.sent += 1
            self.tally.by_kind[kind] += 1
            try:
                backoff = await asyncio.wait_for(self.one(session, kind), self.args.timeout)
                if backoff:
                    await asyncio.sleep(min(backoff, max(0.0, self.deadline - time.monotonic())))
            except TimeoutError:
                self.tally.hung += 1
            except Broke as e:
                self.tally.fail(_reason(str(e)))
            except (aiohttp.ClientError, ConnectionError) as e:
                self.tally.fail(f"connection: {type(e).__name__}")
            except ValueError as e:  # a body that is not the JSON it should be
                self.tally.fail(f"bad JSON in answer: {type(e).__name__}")

    # ---- runner kills -----------------------------------------------------------------
    async def killer(self, session: aiohttp.ClientSession) -> None:
        if not self.args.kill_every:
            return
        while True:
            await asyncio.sleep(self.args.kill_every)
            if time.monotonic() >= self.deadline:
                return
            try:
                async with session.get(self.url + "/api/ps") as response:
                    models = (await response.json()).get("models", [])
            except (aiohttp.ClientError, ValueError):
                continue
            for model in models:
                pid = model.get("runner_pid")
                if pid:
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                        self.tally.kills += 1
                    except ProcessLookupError:
                        pass

    async def run(self) -> dict:
        limits = aiohttp.TCPConnector(limit=0, force_close=False)
        timeout = aiohttp.ClientTimeout(total=None)
        async with aiohttp.ClientSession(connector=limits, timeout=timeout,
                                         headers=self.headers) as session:
            await self.probe_embed(session)
            killer = asyncio.create_task(self.killer(session))
            started = time.monotonic()
            await asyncio.gather(*(self.client(session) for _ in range(self.args.clients)))
            elapsed = time.monotonic() - started
            killer.cancel()
            up = await daemon_up(session, self.url)
        return self.summary(elapsed, up)

    def summary(self, elapsed: float, up: bool) -> dict:
        t = self.tally
        store_ok, blobs, bad = verify_store(Path(self.args.store))
        server_errors = sum(n for reason, n in t.failures.items()
                            if reason.startswith("HTTP 5") and not reason.startswith("HTTP 503"))
        accepted_malformed = sum(n for reason, n in t.failures.items()
                                 if reason.startswith("malformed request answered"))
        return {
            "clients": self.args.clients, "duration_s": round(elapsed, 1),
            "kill_every_s": self.args.kill_every, "runner_kills": t.kills,
            "embed_route": self.has_embed,
            "sent": t.sent, "answered": t.answered, "rejected_503": t.rejected_503,
            "rejected_503_without_retry_after": t.rejected_503_without_retry_after,
            "malformed_refused_4xx": t.refused_as_expected, "cancelled_by_client": t.cancelled,
            "failed": t.failed, "failures": dict(t.failures.most_common()),
            "hung": t.hung, "tracebacks_seen": t.tracebacks,
            "latency_s": percentiles(t.latencies), "first_chunk_s": percentiles(t.first_token),
            "answered_per_s": round(t.answered / elapsed, 2) if elapsed else 0,
            "tokens_generated": t.tokens,
            "tokens_per_s": round(t.tokens / elapsed, 1) if elapsed else 0,
            "by_kind": dict(t.by_kind),
            "daemon_up": up, "store_verified": store_ok, "blobs_checked": blobs,
            "blobs_bad": bad,
            "streams_ended_by_error": t.streams_ended_by_error,
            "streams_cut_silently": t.streams_cut_silently,
            "ok": bool(up and store_ok and not t.hung and not server_errors
                       and not t.tracebacks and not accepted_malformed
                       and not t.streams_cut_silently),
        }


def _short(error: object) -> str:
    if isinstance(error, dict):
        error = error.get("message", error)
    return str(error)[:100]


def _reason(message: str) -> str:
    """Failure messages grouped: the same fault with other numbers in its text counts once
    (the part before the first ': ', such as `HTTP 500 on /api/chat`, is kept as it is)."""
    head, _, tail = message.partition(": ")
    return (head + ": " + "".join("#" if c.isdigit() else c for c in tail))[:160]


async def daemon_up(session: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with session.get(url + "/api/version",
                               timeout=aiohttp.ClientTimeout(total=10)) as response:
            return response.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False


def verify_store(root: Path) -> tuple[bool, int, list[str]]:
    """Every blob's sha256 against its name."""
    bad, count = [], 0
    for blob in sorted((root / "blobs").glob("sha256-*")):
        count += 1
        digest = hashlib.sha256()
        with blob.open("rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
        if digest.hexdigest() != blob.name.removeprefix("sha256-"):
            bad.append(blob.name)
    return (count > 0 and not bad), count, bad


def spawn_daemon() -> tuple[subprocess.Popen, str]:
    """`localllm serve` on a free loopback port and a private socket, with this environment."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    sock = Path(tempfile.mkdtemp(prefix="localllm-soak-")) / "localllm.sock"
    env = {**os.environ, "LOCALLLM_HOST": f"127.0.0.1:{port}", "LOCALLLM_SOCKET": str(sock)}
    proc = subprocess.Popen(serve_command(), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in proc.stdout:
        if line.startswith("{") and json.loads(line).get("event") == "listening":
            return proc, f"http://127.0.0.1:{port}"
    raise SystemExit(f"the daemon exited with {proc.wait()} before listening")


def print_summary(s: dict) -> None:
    print(f"soak: {s['clients']} clients for {s['duration_s']} s, runner killed "
          f"{s['runner_kills']} times (every {s['kill_every_s']} s); embed route: "
          f"{s['embed_route'] or 'none'}")
    print(f"  sent {s['sent']}, answered {s['answered']} ({s['answered_per_s']}/s, "
          f"{s['tokens_generated']} tokens, {s['tokens_per_s']} tok/s), rejected with 503 "
          f"{s['rejected_503']} (without Retry-After: {s['rejected_503_without_retry_after']}), "
          f"malformed refused with 4xx {s['malformed_refused_4xx']}, cancelled by the client "
          f"{s['cancelled_by_client']}, failed {s['failed']}, hung {s['hung']}")
    for reason, count in s["failures"].items():
        print(f"    failed {count:>5}  {reason}")
    print(f"  streams that ended with an error line: {s['streams_ended_by_error']}; streams cut "
          f"with neither their last chunk nor an error: {s['streams_cut_silently']}")
    print(f"  latency of answered requests (s): {s['latency_s']}")
    print(f"  first streamed chunk (s): {s['first_chunk_s']}")
    bad = f", bad: {', '.join(s['blobs_bad'])}" if s["blobs_bad"] else ""
    print(f"  traceback text seen: {s['tracebacks_seen']}; daemon up at the end: "
          f"{s['daemon_up']}; store verifies: {s['store_verified']} "
          f"({s['blobs_checked']} blobs{bad})")
    print(f"  verdict: {'held' if s['ok'] else 'BROKE A RULE'}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--url", default="http://127.0.0.1:11435")
    where.add_argument("--spawn", action="store_true", help="start a daemon for the soak")
    parser.add_argument("--model", default=None, help="default: the config's default_model")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--duration", type=float, default=120.0, help="seconds")
    parser.add_argument("--max-requests", type=int, default=100_000)
    parser.add_argument("--kill-every", type=float, default=20.0, help="seconds; 0: no kills")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="per request: past it a request counts as hung")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--store", default=None, help="store to verify (default: the config's)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from localllm import paths
    from localllm.config import load_config

    config = load_config()
    args.store = args.store or str(paths.models_dir())
    model = args.model or config.default_model
    proc = None
    url = args.url
    if args.spawn:
        proc, url = spawn_daemon()
    loopback_only(url)
    try:
        summary = asyncio.run(Soak(url, model, args, config.api_key).run())
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    print_summary(summary)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        (Path(os.environ["OUT"]) / "soak.json").write_text(json.dumps(summary, indent=2))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
