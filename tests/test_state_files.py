"""No state file the daemon reads can stop a load: whatever a torn write or another process
left in one (not JSON or TOML, bytes that are not UTF-8, nesting 100,000 deep, values of the
wrong type or size), its reader logs it, sets the file aside as NAME.bad-TIMESTAMP and starts
afresh; its writer then writes a sound file."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
from daemon_process import wait_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from localllm.planner.card import load_card
from localllm.profiles import acceptance, calibration, eval_results, expert_hits, traffic
from localllm.profiles.saved import ProfileError, load_profile, read_tables

HOSTILE = [
    b"[" * 100_000, b"{" * 100_000, b"a = " + b"[" * 100_000, b'{"models": ' + b"[" * 50_000,
    b"\xff\xfe\x00garbage", b"", b"   ", b"null", b"[]", b'"text"', b"1e999999",
    json.dumps({"models": {"m": [[1, "x", 3], [10 ** 400, 1, 1], [-1, 2, 3]]}}).encode(),
    json.dumps({"models": []}).encode(), json.dumps({"models": {"m": "rows"}}).encode(),
    b'[m]\nfile_size = 7\nmtp = {drafted = "x", accepted = []}\n',
    b'[m]\nfile_size = 7\n"0.2500" = {hits = "many", misses = 1e400}\nkv = "f16"\n',
    b'[m]\nfile_size = 7\nkv = 5\nvs = [1, 2]\n',
    b'[host]\ndisk_read_gbs = 1' + b"0" * 400 + b'\n["rtx3060-12g"]\ngpu_bandwidth_factor = "x"\n',
    b'[plan]\nn_gpu_layers = "all"\n[predicted]\ndecode_tps = [1]\n',
    b'[plan]\nn_ctx = 4096\n[predicted]\ndecode_tps = 1e999\nmodel_size = "big"\n',
    b'[m]\nfile_size = 7\nmtp = {drafted = 99999999999999999999, accepted = 1}\n',
]
CARD = load_card("rtx3060-12g")


def readers(path: Path) -> None:
    """Every reader of a tuner's state file, on `path`; each must give its default."""
    assert isinstance(traffic.served("m", path), list)
    assert isinstance(read_tables(path), dict)
    assert isinstance(acceptance.measured_acceptance("m", 7, path), dict)
    assert isinstance(expert_hits.measured_hits("m", 7, path), tuple)
    assert isinstance(eval_results.measured_kl("m", 7, path), dict)
    assert calibration.calibrated(CARD, path).name == CARD.name


def writers(path: Path) -> None:
    """Every writer after a reader met the file: it records into a sound file."""
    traffic.record("m", 100, 50, 10, path)
    assert traffic.served("m", path)[-1] == (100, 50, 10)


def _fresh(tmp_path: Path, name: str, content: bytes) -> Path:
    path = tmp_path / name
    for old in tmp_path.glob(name + "*"):
        old.unlink()
    path.write_bytes(content)
    return path


def _check_one(tmp_path: Path, content: bytes) -> None:
    path = _fresh(tmp_path, "record", content)
    readers(path)
    for record_into in (lambda p: traffic.record("m", 100, 50, 10, p),
                        lambda p: acceptance.record("m", 7, "mtp", 40, 30, p),
                        lambda p: expert_hits.record("m", 7, 0.25, 900, 100, 5, 50, p),
                        lambda p: eval_results.save_result("m", 7, "q8_0", "f16",
                                                           {"kl_mean": 0.01}, p)):
        path = _fresh(tmp_path, "record", content)
        record_into(path)  # never raises: a broken file is set aside, a new one written
        readers(path)
    path = _fresh(tmp_path, "profile.toml", content)
    try:
        load_profile(path)
    except ProfileError:
        pass  # a profile that cannot be used is said so, and the model tuned: never a crash


@pytest.mark.parametrize("content", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_contents_leave_every_reader_its_default(tmp_path, content):
    _check_one(tmp_path, content)


@settings(max_examples=80, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.one_of(st.binary(max_size=400),
                 st.text(max_size=200).map(str.encode),
                 st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                              lambda inner: st.lists(inner, max_size=4) |
                              st.dictionaries(st.text(max_size=6), inner, max_size=4),
                              max_leaves=20).map(lambda v: json.dumps(v).encode())))
def test_any_content_at_all_leaves_every_reader_its_default(tmp_path, content):
    _check_one(tmp_path, content)


def test_a_broken_record_is_set_aside_never_deleted_and_written_afresh(tmp_path):
    path = tmp_path / "workload.json"
    path.write_bytes(b"[" * 100_000)
    traffic.record("m", 100, 50, 10, path)
    [aside] = tmp_path.glob("workload.json.bad-*")
    assert aside.read_bytes() == b"[" * 100_000
    assert json.loads(path.read_text()) == {"models": {"m": [[100, 50, 10]]}}


def test_a_workload_record_of_100000_brackets_does_not_stop_a_load(fresh_daemon):
    state = Path(fresh_daemon.env["XDG_STATE_HOME"]) / "localllm"
    state.mkdir(parents=True, exist_ok=True)
    (state / "workload.json").write_bytes(b"[" * 100_000)
    body = json.dumps({"model": "smollm2", "prompt": "Hello", "stream": False,
                       "options": {"num_predict": 4}}).encode()
    req = urllib.request.Request(fresh_daemon.url + "/api/generate", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        assert resp.status == 200 and json.loads(resp.read())["done"]
    # the answer recorded afresh (off the daemon's event loop, soon after it), the bad one
    # set aside, not deleted
    record = state / "workload.json"
    wait_for(record.exists, 30, what="the workload record written again")
    assert list(state.glob("workload.json.bad-*"))
    assert json.loads(record.read_text())["models"]["smollm2:latest"]


def test_a_damaged_chat_database_is_set_aside_and_a_new_one_opened(tmp_path):
    from localllm.tui.chatstore import ChatStore

    path = tmp_path / "chats.db"
    path.write_bytes(b"SQLite format 3\x00" + b"\xff" * 5000)
    store = ChatStore(path)
    chat = store.create_chat("smollm2")
    assert chat and list(tmp_path.glob("chats.db.bad-*"))
    store.close()


def test_a_config_nested_100000_deep_is_a_config_error_with_the_reason():
    """config.toml is the user's own file: it is never set aside, but any content gives the
    one-line ConfigError (the daemon keeps its last good config), never a RecursionError."""
    from localllm.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match="nested too deep"):
        parse_config("a = " + "[" * 100_000)
