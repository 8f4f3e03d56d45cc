"""What a newcomer meets in the first hour (issue 23), through the real command against a real
daemon: names are never replaced by accident, a bad request keeps the loaded model, host values
are checked where they are typed, and one-shot `run` reads pipes and ends."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import pytest

from daemon_process import isolated_env


def one_line_error(result, fragment: str) -> str:
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    assert fragment in lines[0], lines[0]
    return lines[0]


def architecture(daemon, name: str) -> str:
    show = daemon.cli("show", name)
    assert show.returncode == 0, show.stderr
    return show.stdout.split("architecture")[1].split()[0]


def post(daemon, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(daemon.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


# ---- 1. names are never replaced without --force -------------------------------------------
def test_remote_add_cp_and_import_refuse_to_replace_a_name(fresh_daemon, gemma_gguf):
    d = fresh_daemon
    one_line_error(d.cli("remote", "add", "smollm2", "--url", "http://127.0.0.1:1/v1"),
                   "'smollm2:latest' already exists; pass --force")
    one_line_error(d.cli("import", str(gemma_gguf), "--name", "smollm2"), "already exists")
    assert d.cli("import", str(gemma_gguf), "--name", "gemma3-270m").returncode == 0
    one_line_error(d.cli("cp", "gemma3-270m", "smollm2"), "already exists")
    assert architecture(d, "smollm2") == "llama"  # the default model is still itself

    forced = d.cli("cp", "gemma3-270m", "smollm2:other")
    assert forced.returncode == 0 and "replaced" not in forced.stdout
    forced = d.cli("cp", "--force", "smollm2", "smollm2:other")
    assert forced.returncode == 0, forced.stderr
    assert "replaced the model that was 'smollm2:other'" in forced.stdout
    assert architecture(d, "smollm2:other") == "llama"

    # The API keeps Ollama's semantics: /api/copy over an existing name replaces it.
    assert post(d, "/api/copy", {"source": "gemma3-270m", "destination": "smollm2:other"})[0] \
        == 200
    assert architecture(d, "smollm2:other") == "gemma3"

    added = d.cli("remote", "add", "smollm2:other", "--url", "http://127.0.0.1:1/v1", "--force")
    assert added.returncode == 0 and "replaced" in added.stdout, added.stderr


def test_remote_list_and_rm(fresh_daemon):
    d = fresh_daemon
    assert "no remote models" in d.cli("remote", "list").stdout
    assert d.cli("remote", "add", "big", "--url", "http://127.0.0.1:1/v1", "--model",
                 "Qwen/Qwen3-235B", "--api-key-env", "CLUSTER_KEY").returncode == 0
    listing = d.cli("remote", "list")
    assert listing.returncode == 0
    row = next(line for line in listing.stdout.splitlines() if line.startswith("big:latest"))
    assert "Qwen/Qwen3-235B" in row and "http://127.0.0.1:1/v1" in row and "CLUSTER_KEY" in row
    assert "smollm2" not in listing.stdout
    one_line_error(d.cli("remote", "rm", "smollm2"), "is a local model")
    one_line_error(d.cli("remote", "rm", "nope"), "not found")
    removed = d.cli("remote", "rm", "big")
    assert removed.returncode == 0 and "removed remote 'big:latest'" in removed.stdout
    assert "big" not in d.cli("list").stdout and "smollm2" in d.cli("list").stdout


# ---- 2. a request that fails its checks keeps the loaded model -------------------------------
def test_a_speculation_the_model_cannot_do_does_not_unload_it(fresh_daemon):
    d = fresh_daemon
    first = d.cli("run", "smollm2", "--num-predict", "4", "Hi")
    assert first.returncode == 0, first.stderr
    [loaded] = d.ps()
    one_line_error(d.cli("run", "smollm2", "--speculative", "mtp", "hi"), "has no MTP layers")
    one_line_error(d.cli("run", "smollm2", "--draft", "nosuch", "hi"),
                   "draft model 'nosuch' not found")
    assert [m["runner_pid"] for m in d.ps()] == [loaded["runner_pid"]]


# ---- 4. host values ---------------------------------------------------------------------------
def localllm(env, *args, input=None):
    return subprocess.run([sys.executable, "-m", "localllm.cli", *args], env=env, input=input,
                          stdin=subprocess.DEVNULL if input is None else None,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("host, fragment", [
    ("127.0.0.1:99999", "the port must be 0 to 65535"),
    ("127.0.0.1:abc", "the port must be a number"),
    (":abc", "the port must be a number"),
    ("nonsense", "nonsense is neither an IP address nor a name this machine resolves"),
    ("0.0.0.0:11434", "refusing to listen on 0.0.0.0 without an API key"),
])
def test_bad_host_values_are_one_line_everywhere(tmp_path, host, fragment):
    env = isolated_env(tmp_path)
    one_line_error(localllm(env, "serve", "--host", host), fragment)
    one_line_error(localllm({**env, "LOCALLLM_HOST": host}, "serve"), fragment)
    one_line_error(localllm(env, "config", "set", "host", host), fragment)
    config = tmp_path / "xdg_config_home" / "localllm" / "config.toml"
    assert not config.exists() or "host" not in config.read_text()


def test_a_host_with_an_api_key_is_accepted(tmp_path):
    env = isolated_env(tmp_path, LOCALLLM_API_KEY="k")
    result = localllm(env, "config", "set", "host", "0.0.0.0:11434")
    assert result.returncode == 0 and "host = 0.0.0.0:11434" in result.stdout, result.stderr


# ---- 5. one word: a model reference is the model, another word a prompt ---------------------
def test_a_word_that_reads_like_a_model_reference_is_the_model(daemon):
    result = daemon.cli("run", "nosuchmodel:7b")
    assert result.returncode == 1 and result.stdout == "", result.stdout
    assert "Traceback" not in result.stderr
    assert "nosuchmodel:7b" in result.stderr.strip().splitlines()[-1]


def test_a_lone_other_word_is_a_prompt_and_stderr_names_the_model(daemon):
    result = daemon.cli("run", "hello", "--num-predict", "4")
    assert result.returncode == 0, result.stderr
    assert "smollm2 answers the prompt 'hello'" in result.stderr
    assert result.stdout.strip()
    # The README's quick start: a quoted sentence is plainly a prompt, with no note.
    result = daemon.cli("run", "Why is the sky blue?", "--num-predict", "4")
    assert result.returncode == 0 and result.stdout.strip(), result.stderr
    assert "no model is named" not in result.stderr


# ---- 6. piped stdin is part of the prompt -----------------------------------------------------
def prompt_tokens(result) -> int:
    assert result.returncode == 0, result.stderr
    line = next(x for x in result.stderr.splitlines() if x.startswith("prompt eval count:"))
    return int(line.split()[3])


def test_piped_stdin_is_added_to_the_prompt(daemon):
    secret = "The secret word is BANANA, and it is written on the blue door of the house.\n"
    # --keepalive 0: each run reads its whole prompt (no cached prefix to reuse)
    args = ("run", "smollm2", "--num-predict", "4", "--verbose", "--keepalive", "0",
            "Repeat the secret word")
    alone = prompt_tokens(daemon.cli(*args))
    piped = prompt_tokens(daemon.cli(*args, input=secret))
    assert piped >= alone + 15  # the piped sentence was read by the model


# ---- 7. one-shot run ends -----------------------------------------------------------------------
def test_an_answer_that_loops_is_stopped_with_a_note(daemon):
    # Greedy (a line a turn from stdin takes /set), so the loop is the model's every time.
    result = daemon.cli("run", "smollm2", input="/set parameter temperature 0\n"
                        "Say 'ha' 300 times: ha ha ha ha ha ha ha ha ha ha ha ha\n", timeout=600)
    assert result.returncode == 0, result.stderr
    assert "note: stopped: the answer kept repeating the same 3 characters" in result.stderr
    assert 80 <= result.stdout.count("ha") < 1000  # stopped in the loop, far before the cap


def test_num_predict_caps_a_one_shot_answer(daemon):
    result = daemon.cli("run", "smollm2", "--num-predict", "6", "--verbose",
                        "Tell me a long story about a dragon.")
    assert result.returncode == 0, result.stderr
    count = int(next(x for x in result.stderr.splitlines()
                     if x.startswith("eval count:")).split()[2])
    assert 0 < count <= 6


def test_loop_detection_rules():
    from localllm.repeats import repeating_tail

    assert repeating_tail("go " * 100) == 3
    assert repeating_tail("The cat sat. " * 30) == len("The cat sat. ")
    assert repeating_tail("1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 " * 2) == 0
    assert repeating_tail("go " * 5) == 0  # too short to call a loop
    assert repeating_tail(" " * 500) == 0  # padding is not a loop of words


# ---- 9. a model's digest names all of it; an unknown route is not a missing model -------------
def tags_digests(daemon) -> dict:
    return {m["name"]: m["digest"] for m in daemon.get("/api/tags")["models"]}


def test_tags_digest_changes_with_any_layer_and_survives_a_copy(daemon):
    template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    status, body = post(daemon, "/api/create", {"model": "smollm2-plain", "from": "smollm2",
                                                "template": template, "stream": False})
    assert status == 200, body
    assert post(daemon, "/api/copy", {"source": "smollm2", "destination": "smollm2-same"})[0] \
        == 200
    try:
        digests = tags_digests(daemon)
        assert digests["smollm2-plain:latest"] != digests["smollm2:latest"]
        assert digests["smollm2-same:latest"] == digests["smollm2:latest"]
        assert all(len(d) == 64 for d in digests.values())
    finally:
        for name in ("smollm2-plain", "smollm2-same"):
            request = urllib.request.Request(daemon.url + "/api/delete", method="DELETE",
                                             data=json.dumps({"model": name}).encode())
            urllib.request.urlopen(request, timeout=60).close()


def test_an_unknown_route_is_not_model_not_found(daemon):
    status, body = post(daemon, "/v1/no-such-route", {})
    assert status == 404 and body["error"]["code"] != "model_not_found"
    status, body = post(daemon, "/v1/chat/completions", {
        "model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]})
    assert status == 404 and body["error"]["code"] == "model_not_found"


# ---- 10. small ones ----------------------------------------------------------------------------
def test_a_non_streamed_generate_reports_its_time_to_first_token(daemon):
    status, body = post(daemon, "/api/generate", {"model": "smollm2", "prompt": "Hi",
                                                  "stream": False,
                                                  "options": {"num_predict": 3}})
    assert status == 200, body
    ttft = body["stats"]["time_to_first_token"]
    assert 0 < ttft <= body["total_duration"]


def test_config_show_into_a_closed_pipe_prints_no_error(tmp_path):
    env = isolated_env(tmp_path)
    for _ in range(5):  # the race between the reader closing and the writer flushing
        result = subprocess.run(["bash", "-c", f"{sys.executable} -m localllm.cli config show "
                                 "| head -1"], env=env, capture_output=True, text=True,
                                timeout=60)
        assert result.stdout.startswith("# ") and result.stderr == "", result.stderr


# ---- 3. tune --measure: --no-save saves nothing, a disturbed figure is not kept -----------------
def test_tune_measure_no_save_writes_nothing(tmp_path, smollm2_gguf):
    env = isolated_env(tmp_path)
    result = localllm(env, "tune", str(smollm2_gguf), "--measure", "--no-save")
    assert result.returncode == 0, result.stderr
    assert "measured: prefill" in result.stdout
    written = [p for p in (tmp_path / "xdg_config_home").rglob("*") if p.is_file()]
    assert written == []


def test_tune_reset_calibration_forgets_measure_and_keeps_calibrate(tmp_path):
    import tomllib

    env = isolated_env(tmp_path)
    path = tmp_path / "xdg_config_home" / "localllm" / "profiles" / "calibration.toml"
    path.parent.mkdir(parents=True)
    path.write_text('[cpu-only]\nhost_bandwidth_factor = 0.06\nmeasured_decode_tps = 2.4\n'
                    '[rtx3060-12g]\nmemory_bandwidth_gbs = 340.0\ngpu_bandwidth_factor = 0.5\n')
    result = localllm(env, "tune", "--reset-calibration")
    assert result.returncode == 0, result.stderr
    assert "calibration reset for cpu-only, rtx3060-12g" in result.stdout
    assert tomllib.loads(path.read_text()) == {"rtx3060-12g": {"memory_bandwidth_gbs": 340.0}}
    again = localllm(env, "tune", "--reset-calibration")
    assert "nothing to reset" in again.stdout
    one_line_error(localllm(env, "tune"), "tune needs a MODEL")


def test_a_slow_figure_on_a_busy_machine_is_doubtful():
    from localllm.profiles.measure import Measurement, doubtful

    def measured(tps, load):
        return Measurement(prefill_tps=100, decode_tps=tps, vram_bytes=0, prompt_tokens=128,
                           decoded_tokens=32, other_load=load)

    assert "other processes kept 1.6 CPU cores busy" in doubtful(measured(2.4, 1.6), 36.0)
    assert doubtful(measured(2.4, 0.1), 36.0) is None  # slow on a quiet machine: the truth
    assert doubtful(measured(30.0, 1.6), 36.0) is None  # near the prediction: fine


# ---- edges: stopping the daemon without systemd --------------------------------------------
def test_stop_daemon_and_service_status_outside_systemd(fresh_daemon):
    d = fresh_daemon
    status = d.cli("service", "status")
    assert status.returncode == 0, status.stderr
    assert f"a localllm daemon is running outside systemd: pid {d.proc.pid}" in status.stdout
    assert str(d.socket) in status.stdout and "`localllm stop --daemon` stops it" in status.stdout
    one_line_error(d.cli("stop"), "pass --daemon")

    stopped = d.cli("stop", "--daemon")
    assert stopped.returncode == 0, stopped.stderr
    assert stopped.stdout == f"stopped the localllm daemon (pid {d.proc.pid})\n"
    assert d.proc.poll() == 0  # gone by the time the command returned, and cleanly

    again = d.cli("stop", "--daemon")
    assert (again.returncode, again.stdout, again.stderr) == \
        (0, "no localllm daemon is running\n", "")
    one_line_error(d.cli("service", "status"), "not installed and no daemon is running")


# ---- edges: a base model is named as one before its download -------------------------------
@pytest.mark.errors_expected  # the pull fails on purpose: there is no package index here
def test_run_of_a_base_model_says_so_before_pulling_it(tmp_path):
    from daemon_process import start_daemon

    no_index = tmp_path / "no-index"
    no_index.mkdir()
    env = isolated_env(tmp_path / "d", PIP_NO_INDEX="1", PIP_FIND_LINKS=str(no_index))
    d = start_daemon(env)
    try:
        warned = d.cli("run", "gemma3-270m", "hi")
        assert warned.returncode == 1
        first, *rest = warned.stderr.strip().splitlines()
        assert first == ("note: gemma3-270m is a base model: it continues text rather than "
                         "answering it (--raw sends the prompt as it is and skips this note); "
                         "`localllm run gemma3-270m:it-q8` is its instruct version")
        assert rest and rest[-1].startswith("Error: ")  # then the download was tried
        silent = d.cli("run", "--raw", "gemma3-270m", "hi")
        assert silent.returncode == 1 and "base model" not in silent.stderr
        instruct = d.cli("run", "smollm2:nosuch", "hi")
        assert "base model" not in instruct.stderr
    finally:
        d.stop()


def test_run_raw_sends_the_prompt_without_the_template(daemon):
    prompt = "The oldest lighthouse of Brittany stands"  # 7 words: about as many tokens

    def prompt_tokens(*flags: str) -> int:
        """The whole prompt the runner got, cached prefix included (from /api/stats)."""
        result = daemon.cli("run", "smollm2", "--num-predict", "4", *flags, prompt)
        assert result.returncode == 0, result.stderr
        smollm2 = next(m for m in daemon.get("/api/stats")["models"]
                       if m["model"] == "smollm2:latest")
        return smollm2["last"]["prompt_tokens"]

    raw = prompt_tokens("--raw")
    assert 5 <= raw <= 10
    # The chat template adds role markers and SmolLM2's default system message around it.
    assert prompt_tokens() > raw + 10


# ---- edges: a context past what the model takes is capped with a note ----------------------
def test_a_ctx_past_the_trained_context_is_capped_with_a_note(daemon):
    try:
        result = daemon.cli("run", "smollm2", "--ctx", "999999", "--num-predict", "2", "hi")
        assert result.returncode == 0, result.stderr
        assert "note: --ctx 999999 was capped at 8192: smollm2 was trained for 8192 tokens" \
            in result.stderr.splitlines()
        fits = daemon.cli("run", "smollm2", "--ctx", "2048", "--num-predict", "2", "hi")
        assert fits.returncode == 0 and "capped" not in fits.stderr
    finally:
        daemon.unload("smollm2")


# ---- edges: show has ollama show's sections --------------------------------------------------
def test_show_has_capabilities_parameters_system_and_license(daemon):
    status, _ = post(daemon, "/api/create", {
        "model": "shown-smollm2", "from": "smollm2", "parameters": {"temperature": 0.2},
        "system": "Answer briefly.\nIn English.\nNever in verse.", "stream": False})
    assert status == 200
    shown = daemon.cli("show", "shown-smollm2")
    assert shown.returncode == 0, shown.stderr
    sections = {}
    for block in shown.stdout.split("\n\n"):
        title, *rows = block.strip("\n").splitlines()
        sections[title.strip()] = [row.strip() for row in rows]
    assert list(sections) == ["Model", "Capabilities", "Parameters", "System", "License"]
    assert sections["Capabilities"] == ["completion"]
    parameters = [row.split(None, 1) for row in sections["Parameters"]]
    assert ["temperature", "0.2"] in parameters and ["stop", '"<|im_end|>"'] in parameters
    assert sections["System"] == ["Answer briefly.", "In English.", "..."]  # as ollama shows
    assert sections["License"] == ["apache-2.0"]  # the GGUF's general.license
