"""The prompt cache on disk (engine/runner/disk_cache.py, disk_format.py): a long prompt's KV
kept past an unload and a daemon restart, read back only when whole and made for the same
model and KV layout, within a byte budget.

The files' format, key and budget are tested on their own (no model loaded); the rest on a real
daemon with real llama.cpp and SmolLM2, through the Ollama and OpenAI clients.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import stat
import time
from pathlib import Path
from types import SimpleNamespace

import openai
import pytest
from localllm.engine.runner import disk_format
from localllm.engine.runner.disk_cache import MIN_TOKENS, DiskCache
from localllm.engine.runner.disk_format import DamagedFile
from localllm.engine.state import Checkpoint, SavedSequence
from localllm.planner.plan import cpu_plan

from daemon_process import isolated_env, start_daemon

KEY = "k" * 32


def saved_of(tokens, nbytes: int = 4096, checkpoints=()) -> SavedSequence:
    data = (ctypes.c_uint8 * nbytes)(*(i % 251 for i in range(nbytes)))
    return SavedSequence(tuple(tokens), data, pos_min=3, checkpoints=tuple(checkpoints))


def prompt_tokens(n: int = MIN_TOKENS + 10, first: int = 1) -> list[int]:
    return [first + i for i in range(n)]


# ---- the file format ---------------------------------------------------------------------
def test_a_file_reads_back_as_it_was_written_and_is_the_users_alone(tmp_path):
    # an image's placeholder is a negative 62-bit number (engine/vision.py): it must survive
    tokens = [*prompt_tokens(), -(1 << 61)]
    checkpoint = Checkpoint(500, (ctypes.c_uint8 * 300)(*range(300 % 256), *[7] * 44), "end")
    saved = saved_of(tokens, checkpoints=[checkpoint])
    path = tmp_path / disk_format.file_name(tokens)
    size = disk_format.write(path, saved, KEY)
    assert path.stat().st_size == size
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left

    entry = disk_format.read_entry(path, KEY)
    assert entry.tokens == tuple(tokens) and entry.pos_min == 3
    assert [(c.n_tokens, c.kind, c.nbytes) for c in entry.checkpoints] == [(500, "end", 300)]
    back = disk_format.read_saved(entry)
    assert back.tokens == saved.tokens and back.pos_min == saved.pos_min
    assert bytes(back.data) == bytes(saved.data)
    assert [(c.n_tokens, c.kind, bytes(c.data)) for c in back.checkpoints] == \
        [(500, "end", bytes(checkpoint.data))]


@pytest.mark.parametrize("damage", ["truncated", "payload byte", "token byte", "header",
                                    "magic", "longer"])
def test_a_damaged_file_is_never_read_as_a_state(tmp_path, damage):
    path = tmp_path / "x.kv"
    disk_format.write(path, saved_of(prompt_tokens()), KEY)
    data = bytearray(path.read_bytes())
    header_end = 12 + int.from_bytes(data[8:12], "little")
    if damage == "truncated":
        data = data[:-100]
    elif damage == "payload byte":
        data[-10] ^= 0x40
    elif damage == "token byte":
        data[header_end + 16] ^= 0x01
    elif damage == "header":
        data[20] = ord("#")
    elif damage == "magic":
        data[0] ^= 0xFF
    else:
        data += b"\0"
    path.write_bytes(bytes(data))
    with pytest.raises(DamagedFile):
        disk_format.read_saved(disk_format.read_entry(path, KEY))


def test_a_file_of_another_key_is_refused(tmp_path):
    path = tmp_path / "x.kv"
    disk_format.write(path, saved_of(prompt_tokens()), KEY)
    with pytest.raises(DamagedFile, match="another model or KV layout"):
        disk_format.read_entry(path, "o" * 32)


# ---- the key ----------------------------------------------------------------------------
def context(**lm):
    return SimpleNamespace(**{"n_seq": 1, "recurrent": False, "n_rollback": 0, "n_swa": 0,
                              "ctx": None, **lm})


def test_the_key_follows_what_shapes_the_kv_and_nothing_else(tmp_path):
    model = tmp_path / ("sha256-" + "a" * 64)  # as the store names a blob
    model.write_bytes(b"weights")
    plan, lm = cpu_plan(4096), context()
    key = disk_format.kv_key(model, plan, lm)
    # what the KV is made of: another key
    for other in (dataclasses.replace(plan, type_k="q8_0"),
                  dataclasses.replace(plan, type_v="q8_0"),
                  dataclasses.replace(plan, flash_attn=not plan.flash_attn)):
        assert disk_format.kv_key(model, other, lm) != key
    assert disk_format.kv_key(model, plan, context(n_seq=2)) != key  # one stream per slot
    assert disk_format.kv_key(model, plan, context(recurrent=True, n_rollback=4)) != key
    # what only places or paces the work, or gives more room: the same key
    for same in (dataclasses.replace(plan, n_ctx=8192), dataclasses.replace(plan, n_threads=7),
                 dataclasses.replace(plan, n_gpu_layers=12),
                 dataclasses.replace(plan, n_batch=256, n_ubatch=256)):
        assert disk_format.kv_key(model, same, lm) == key
    # another model file (another size or time: edited or replaced): another key
    model.write_bytes(b"other weights")
    assert disk_format.kv_key(model, plan, lm) != key


# ---- the cache: lookup, budget, damage ---------------------------------------------------
def cache_of(tmp_path: Path, budget: int, plan=None, keep_contained: bool = False) -> DiskCache:
    model_file = tmp_path / "model.gguf"
    if not model_file.exists():
        tmp_path.mkdir(exist_ok=True)
        model_file.write_bytes(b"weights")
    model = SimpleNamespace(lm=context(), plan=plan or cpu_plan(4096))
    return DiskCache(tmp_path / "prompts", budget, model, str(model_file), keep_contained)


def whole(entry, common):  # full attention: any shared prefix is reusable
    return common


def files(cache: DiskCache) -> list[Path]:
    return sorted(cache.root.glob("*/*.kv"))


def test_the_files_stay_within_the_budget_least_recently_used_first(tmp_path):
    one = saved_of(prompt_tokens(first=1), nbytes=20_000)
    size = len(disk_format.MAGIC) + 4 + 400 + 8 * len(one.tokens) + 20_000  # about
    cache = cache_of(tmp_path, budget=int(2.5 * size))
    key = cache.key()
    a, b, c = (saved_of(prompt_tokens(first=f), nbytes=20_000) for f in (1, 100_000, 200_000))
    for n, saved in enumerate((a, b), start=1):  # a used first, then b
        assert cache.write(saved, key)
        os.utime(cache.root / key / disk_format.file_name(saved.tokens), (n, n))
    assert stat.S_IMODE((cache.root / key).stat().st_mode) == 0o700
    assert stat.S_IMODE(cache.root.stat().st_mode) == 0o700
    # a request that starts with a's tokens reads it: its use is now the latest
    entry, n = cache.best([*a.tokens, 5, 6], whole)
    assert n == len(a.tokens) and cache.load(entry) is not None
    assert cache.write(c, key)  # over the budget: b, the least recently used, goes
    names = {p.name for p in files(cache)}
    assert names == {disk_format.file_name(t.tokens) for t in (a, c)}
    assert sum(p.stat().st_size for p in files(cache)) <= cache.budget
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files(cache))
    # a prompt larger than the whole budget is not written
    assert not cache.write(saved_of(prompt_tokens(first=7), nbytes=3 * size), key)
    # a prompt too short to be worth a file is not either
    assert not cache.write(saved_of(prompt_tokens(MIN_TOKENS - 1, first=9)), key)


def test_a_longer_prompt_replaces_the_one_it_contains_unless_the_model_needs_both(tmp_path):
    short = saved_of(prompt_tokens())
    longer = saved_of([*short.tokens, 1, 2, 3])
    cache = cache_of(tmp_path / "full", 10**8)
    assert cache.write(short, cache.key()) and cache.write(longer, cache.key())
    assert [p.name for p in files(cache)] == [disk_format.file_name(longer.tokens)]
    assert not cache.write(short, cache.key())  # the longer file holds it already
    sliding = cache_of(tmp_path / "swa", 10**8, keep_contained=True)
    assert sliding.write(short, sliding.key()) and sliding.write(longer, sliding.key())
    assert len(files(sliding)) == 2


def test_prompts_the_ram_cache_lets_go_are_written_by_the_writer_thread(tmp_path):
    from localllm.engine.runner.reuse import PromptCache

    cache = cache_of(tmp_path, 10**8)
    evicted = []
    ram = PromptCache(10_000, on_evict=evicted.append)
    first, second = saved_of(prompt_tokens(), 6000), saved_of(prompt_tokens(first=10**6), 6000)
    assert ram.put(first) and ram.put(second)  # no room for both: the older goes
    assert evicted == [first]
    for saved in evicted:
        cache.put(saved, cache.key())
    cache.put(saved_of(prompt_tokens(MIN_TOKENS - 1)), cache.key())  # too short: no file
    cache.drain(deadline=time.monotonic() + 60)
    assert [p.name for p in files(cache)] == [disk_format.file_name(first.tokens)]
    # a prompt a newer one contains leaves RAM without going to disk (the newer serves it)
    ram.put(saved_of([*second.tokens, 1], 6000))
    assert evicted == [first]


def test_a_file_of_other_kv_settings_is_not_used(tmp_path, caplog):
    f16 = cache_of(tmp_path, 10**8)
    saved = saved_of(prompt_tokens())
    assert f16.write(saved, f16.key())
    q8 = cache_of(tmp_path, 10**8, plan=dataclasses.replace(cpu_plan(4096), type_k="q8_0",
                                                           type_v="q8_0"))
    assert q8.key() != f16.key()
    assert q8.best(list(saved.tokens), whole) == (None, 0)
    # even moved into that layout's folder, the file's header says whose it is
    moved = q8.root / q8.key() / files(f16)[0].name
    moved.parent.mkdir(mode=0o700)
    os.link(files(f16)[0], moved)
    q8 = cache_of(tmp_path, 10**8, plan=q8.model.plan)  # a runner started now
    with caplog.at_level(logging.WARNING, logger="localllm.runner"):
        assert q8.best(list(saved.tokens), whole) == (None, 0)
    assert "another model or KV layout" in caplog.text and not moved.exists()
    assert f16.best(list(saved.tokens), whole)[1] == len(saved.tokens)


def test_a_file_damaged_after_it_was_indexed_is_deleted_with_a_log_line(tmp_path, caplog):
    cache = cache_of(tmp_path, 10**8)
    saved = saved_of(prompt_tokens())
    cache.write(saved, cache.key())
    entry, _ = cache.best(list(saved.tokens), whole)
    path = files(cache)[0]
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x10
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="localllm.runner"):
        assert cache.load(entry) is None
    assert "is damaged" in caplog.text and not path.exists()
    assert cache.best(list(saved.tokens), whole) == (None, 0)


# ---- a real daemon ------------------------------------------------------------------------
def long_prompt() -> str:
    """About 1,100 tokens of distinct lines, templated: just past MIN_TOKENS (a CPU shared
    with other tests reads SmolLM2's prompts at 20-60 tokens/s)."""
    return "\n".join(f"Rule {i}: the {['red', 'green', 'blue', 'white'][i % 4]} tool number "
                     f"{i} returns {i * 7} items." for i in range(55)) + "\nSummarize rule 3."


def chat(daemon, prompt: str) -> dict:
    """POST /api/chat as it answers (the ollama client's model drops the cached count)."""
    import json
    import urllib.request

    body = json.dumps({"model": "smollm2", "stream": False,
                       "messages": [{"role": "user", "content": prompt}],
                       "options": {"temperature": 0, "num_predict": 8}}).encode()
    request = urllib.request.Request(daemon.url + "/api/chat", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


def cache_files(daemon) -> list[Path]:
    return sorted((Path(daemon.env["XDG_CACHE_HOME"]) / "localllm" / "prompts").glob("*/*.kv"))


def test_a_long_prompt_is_read_from_disk_after_an_unload_and_a_restart(tmp_path,
                                                                        smollm2_gguf):
    from conftest import import_models

    # One slot, a fixed context: the same KV layout on every load (the slot count is part of it)
    env = isolated_env(tmp_path, LOCALLLM_NUM_PARALLEL="1", LOCALLLM_CONTEXT_POLICY="fixed",
                       LOCALLLM_CONTEXT_LENGTH="4096")
    import_models(env, {"smollm2": smollm2_gguf})
    prompt = long_prompt()
    longer = prompt + "\nThen summarize rule 4 as well."
    daemon = start_daemon(env)
    try:
        cold = chat(daemon, prompt)
        total = cold["prompt_eval_count"]  # (as Ollama's: the whole prompt, cached or not)
        assert total > MIN_TOKENS and cold["prompt_eval_cached_count"] == 0
        assert daemon.cli("stop", "smollm2").returncode == 0  # `localllm stop MODEL`
        [saved] = cache_files(daemon)
        assert stat.S_IMODE(saved.stat().st_mode) == 0o600
        assert stat.S_IMODE(saved.parent.stat().st_mode) == 0o700

        # after the unload: read from disk, counted as cached (through OpenAI's client here)
        client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", timeout=600,
                               max_retries=0)
        warm = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": prompt}], max_tokens=8,
            temperature=0)
        cached = warm.usage.prompt_tokens_details.cached_tokens
        assert warm.usage.prompt_tokens == total
        assert total - cached <= 0.05 * total, (cached, total)
        assert warm.choices[0].message.content == cold["message"]["content"]
        # the conversation goes on: the daemon's shutdown writes its longer prompt
        grown = chat(daemon, longer)
        assert grown["prompt_eval_count"] - grown["prompt_eval_cached_count"] < 40
    finally:
        daemon.stop()

    daemon = start_daemon(env)  # the same home: a restart
    try:
        again = chat(daemon, longer)
        read = again["prompt_eval_count"] - again["prompt_eval_cached_count"]
        assert read <= 0.05 * again["prompt_eval_count"], again
        stats = daemon.get("/api/stats")
        assert [m["last"]["cached_from"] for m in stats["models"]] == ["disk"], stats

        # Damaged files (every prompt's: the template ends a prompt other than the longer one
        # goes on, and an answer read on from another cut may differ in a token): deleted with
        # a log line, the prompt read whole, the answer a cold read gives.
        assert daemon.cli("stop", "smollm2").returncode == 0
        saved = cache_files(daemon)
        assert 2 <= len(saved) <= 3  # (three files at most are tried per request)
        for path in saved:
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0xFF
            path.write_bytes(bytes(data))
        damaged = chat(daemon, prompt)
        assert damaged["prompt_eval_cached_count"] == 0
        assert damaged["message"]["content"] == cold["message"]["content"]
        log = (Path(env["XDG_STATE_HOME"]) / "localllm" / "logs" / "runner.log").read_text()
        assert log.count("is damaged (its bytes do not match their hash)") == len(saved)
        assert not any(path.exists() for path in saved)
    finally:
        daemon.stop()


# ---- a sliding-window model: its checkpoints go to disk with its prompt -----------------
async def runner_answer(load, log: Path, prompt: str) -> tuple[str, object]:
    from localllm.engine.local import RunnerProcess
    from localllm.engine.runner.protocol import (
        RUNNER_COMMAND, Done, GenerationRequest, SamplingOptions)

    runner = RunnerProcess.of("m", load, log, RUNNER_COMMAND)
    await runner.start()
    try:
        text, done = [], None
        async for event in runner.generate(GenerationRequest(
                id="r", prompt=prompt, options=SamplingOptions(num_predict=8, temperature=0))):
            if isinstance(event, Done):
                done = event
            elif hasattr(event, "text"):
                text.append(event.text)
        return "".join(text), done
    finally:
        await runner.stop()  # the runner writes its slot's prompt to disk as it ends


async def test_a_sliding_window_prompt_comes_back_from_disk_with_its_checkpoints(
        tmp_path, gemma_gguf):
    """Gemma 3 keeps the last 512 positions of its sliding-window layers: a prompt diverging
    from a saved one 700 tokens before its end can reuse it only up to a spaced checkpoint,
    which must have come back from disk with it (no RAM cache here: a new runner each time)."""
    from localllm.engine.runner.load import Load

    plan = dataclasses.replace(cpu_plan(4096), n_parallel=1)
    words = [f"w{i}" for i in range(560)]
    # about 2,100 tokens: checkpoints kept at 1024 and 1536 (spaced), 4 + 512 and 4 before the
    # end, and the end
    first = " ".join(words) + " end."
    # diverges near token 1,400; a continuation the model is sure of (this small base model's
    # unsure ones flip with the rounding of other prompt chunks, as a cold read's split is)
    then = " ".join(words[:370]) + " Count on: w1 w2 w3 w4 w5"
    load = Load(plan, model_path=gemma_gguf, prompt_disk_dir=tmp_path / "prompts",
                prompt_disk_bytes=256 << 20)
    _, cold = await runner_answer(load, tmp_path / "r0.log", first)
    assert cold.prompt_tokens > 2000
    text, warm = await runner_answer(load, tmp_path / "r1.log", then)
    assert (warm.cached_from, warm.checkpoint, warm.cached_tokens) == ("disk", 1024, 1024)
    # the answer a runner that never saw the first prompt gives
    alone = dataclasses.replace(load, prompt_disk_dir=tmp_path / "elsewhere")
    text_alone, read_alone = await runner_answer(alone, tmp_path / "r2.log", then)
    assert read_alone.cached_tokens == 0 and text == text_alone


async def test_a_long_prefix_with_another_last_turn_reads_only_that_turn_from_disk(
        tmp_path, gemma_gguf):
    """The same system prompt and tools with another short user message (an agent's next
    session after `localllm stop`): the prompts diverge a few tokens before the saved one's
    end, where Gemma's sliding window cannot be cut back to. The checkpoint a micro-batch
    before the saved prompt's end comes back from disk with it, so only about a micro-batch
    is read again, not everything since the latest spaced checkpoint (issue #67: at most 5%
    of a 20K prefix; bench_prompt_disk.py measures that size)."""
    from localllm.engine.runner.load import Load

    plan = dataclasses.replace(cpu_plan(4096), n_parallel=1, n_ubatch=64)
    prefix = " ".join(f"w{i}" for i in range(380))  # about 1,400 tokens: spaced every 512
    first = prefix + " Now count on: a1 a2 a3 a4 a5"
    then = prefix + " Now count on: b1 b2 b3 b4 b5"  # (an answer the model is sure of)
    load = Load(plan, model_path=gemma_gguf, prompt_disk_dir=tmp_path / "prompts",
                prompt_disk_bytes=256 << 20)
    _, cold = await runner_answer(load, tmp_path / "r0.log", first)
    n1 = cold.prompt_tokens
    assert n1 > MIN_TOKENS
    text, warm = await runner_answer(load, tmp_path / "r1.log", then)
    kept = n1 - 4 - 64  # checkpoints.ends: NEAR_END + n_ubatch before the first prompt's end
    assert (warm.cached_from, warm.checkpoint, warm.cached_tokens) == ("disk", kept, kept)
    assert warm.prompt_tokens - warm.cached_tokens < 100
    # the answer a runner that never saw the first prompt gives
    alone = dataclasses.replace(load, prompt_disk_dir=tmp_path / "elsewhere")
    text_alone, read_alone = await runner_answer(alone, tmp_path / "r2.log", then)
    assert read_alone.cached_tokens == 0 and text == text_alone
