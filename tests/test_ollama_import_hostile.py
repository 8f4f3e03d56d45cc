"""`import --from-ollama` against a hostile Ollama store laid out by the test: a blob whose name
lies about its content, a blob that is a symbolic link out of the store, a damaged projector and
manifests of odd shapes. Every blob is hashed before it is published, a symlink is copied (never
linked), a refused model leaves nothing (no blob, no changed mode), and one odd manifest is
skipped with the reason while the others are imported."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from test_ollama_habits import cli, ollama_blob, ollama_manifest, one_line_error


@pytest.fixture
def daemon_(tmp_path):
    """A daemon whose store is empty."""
    from daemon_process import isolated_env, start_daemon

    d = start_daemon(isolated_env(tmp_path / "e"))
    yield d
    d.stop()


def _ours(daemon) -> Path:
    return Path(daemon.env["XDG_DATA_HOME"]) / "localllm" / "models" / "blobs"


def _names(daemon) -> set[str]:
    return {m["name"] for m in daemon.get("/api/tags")["models"]}


@pytest.fixture
def store(tmp_path, smollm2_gguf) -> tuple[Path, dict]:
    root = tmp_path / "ollama-models"
    return root, ollama_blob(root, source=smollm2_gguf)


def test_a_blob_whose_name_lies_is_refused_and_nothing_changes(daemon_, store):
    root, model = store
    liar = hashlib.sha256(b"another file").hexdigest()
    real = root / "blobs" / f"sha256-{model['digest'].split(':')[1]}"
    lying = root / "blobs" / f"sha256-{liar}"
    lying.write_bytes(real.read_bytes())  # the model's bytes under another file's name
    lying.chmod(0o644)
    ollama_manifest(root, "liar", "latest", {"model": {"digest": f"sha256:{liar}",
                                                       "size": lying.stat().st_size}})
    one_line_error(cli(daemon_, "import", "--from-ollama", "liar",
                       OLLAMA_MODELS=str(root)), "does not hash to its name")
    assert "liar:latest" not in _names(daemon_)
    assert not list(_ours(daemon_).glob("sha256-*")), "no blob stored"
    assert not list((_ours(daemon_).parent / "tmp").glob("*")), "nothing left staged"
    assert lying.stat().st_mode & 0o777 == 0o644, "Ollama's file untouched"


def test_a_symlinked_blob_is_copied_never_linked(daemon_, store, tmp_path, smollm2_gguf):
    root, model = store
    real = root / "blobs" / f"sha256-{model['digest'].split(':')[1]}"
    outside = tmp_path / "elsewhere.gguf"
    real.rename(outside)
    outside.chmod(0o644)
    real.symlink_to(outside)
    ollama_manifest(root, "linked", "latest", {"model": model})
    result = cli(daemon_, "import", "--from-ollama", "linked", OLLAMA_MODELS=str(root))
    assert result.returncode == 0, result.stderr
    assert "copied" in result.stdout and "symbolic link" in result.stdout
    ours = _ours(daemon_) / real.name
    assert ours.is_file() and not ours.is_symlink()
    assert ours.stat().st_ino != outside.stat().st_ino
    assert outside.stat().st_mode & 0o777 == 0o644, "the file outside both stores untouched"
    assert "linked:latest" in _names(daemon_)


def test_a_damaged_projector_refuses_the_whole_model(daemon_, store):
    root, model = store
    ollama_manifest(root, "seer", "latest", {
        "model": model, "projector": ollama_blob(root, b"this is not a projector\n" * 40)})
    one_line_error(cli(daemon_, "import", "--from-ollama", "seer",
                       OLLAMA_MODELS=str(root)), "vision projector")
    assert "seer:latest" not in _names(daemon_), "not listed without its projector"
    assert not list(_ours(daemon_).glob("sha256-*")), "no blob stored"
    real = root / "blobs" / f"sha256-{model['digest'].split(':')[1]}"
    assert real.stat().st_mode & 0o777 == 0o644, "no mode changed for a refused model"
    # --force cannot link a text file as the projector either
    one_line_error(cli(daemon_, "import", "--from-ollama", "seer", "--force",
                       OLLAMA_MODELS=str(root)), "vision projector")


def test_odd_manifests_are_skipped_and_the_rest_imported(daemon_, store):
    root, model = store
    ollama_manifest(root, "good", "latest", {"model": model})
    ollama_manifest(root, "bigsize", "latest", {"model": {**model, "size": "big"}})
    odd = root / "manifests" / "registry.ollama.ai" / "library" / "oddlayers" / "latest"
    odd.parent.mkdir(parents=True)
    odd.write_text(json.dumps({"schemaVersion": 2, "layers": ["x", 1]}))
    deep = root / "manifests" / "registry.ollama.ai" / "library" / "deep" / "latest"
    deep.parent.mkdir(parents=True)
    deep.write_text("[" * 100_000)
    result = cli(daemon_, "import", "--from-ollama", OLLAMA_MODELS=str(root))
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    for name in ("bigsize", "oddlayers", "deep"):
        assert f"skipped {name}:latest: " in result.stdout, result.stdout
    assert "imported good:latest" in result.stdout
    assert _names(daemon_) == {"good:latest"}
