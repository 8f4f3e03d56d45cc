"""`localllm pull hf.co/OWNER/REPO` without a quant: every GGUF of the repo planned for the card
from its header (range requests to a local hub), the best pulled; `--quant` overrides.

The repo holds sparse synthetic files of a 27B dense shape (scripts/synth_gguf.py): real headers
and sizes, no weights on disk. On a 12 GiB card Q3_K_M is the largest that fits whole (Q4_K_M,
13.9 GiB, does not); on a 24 GiB card Q6_K (20.2 GiB) does, Q8_0 (26.2 GiB, split in two) not.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest
from scripts import synth_gguf

from hub_server import FILE, REPO

DENSE = "test/Dense-27B-GGUF"
QUANTS = {"Q2_K": "Q2_K", "Q3_K_M": "Q3_K", "Q4_K_M": "Q4_K", "Q6_K": "Q6_K"}
MiB = 1 << 20


@pytest.fixture(scope="module")
def dense_files(tmp_path_factory) -> dict[str, object]:
    """{repo path: local file}: four quants, a Q8_0 split in two, and a vision projector."""
    d = tmp_path_factory.mktemp("dense-27b-repo")
    config = synth_gguf.SHAPES["dense-27b"]
    files = {}
    for label, ggml in QUANTS.items():
        files[f"Dense-27B-{label}.gguf"] = synth_gguf.write_gguf(
            d / f"Dense-27B-{label}.gguf", config, ggml)
    for i in range(2):
        name = f"Dense-27B-Q8_0-{i + 1:05d}-of-00002.gguf"
        files[name] = synth_gguf.write_gguf(d / name, config, "Q8_0", split=(i, 2))
    files["mmproj-Dense-27B-f16.gguf"] = synth_gguf.write_gguf(
        d / "mmproj.gguf", synth_gguf.tiny(config), "F16")
    return files


def serve(hub, repo: str, files: dict) -> None:
    for path, source in files.items():
        # A published hash spares hashing 100 GiB of holes; only headers are read.
        hub.add(repo, path, source, published_sha256=hashlib.sha256(
            f"{repo}/{path}".encode()).hexdigest())


@pytest.fixture
def env(home, hub, dense_files, monkeypatch) -> dict:
    monkeypatch.delenv("HF_TOKEN", raising=False)
    serve(hub, DENSE, dense_files)
    return {**os.environ, "LOCALLLM_HF_ENDPOINT": hub.url, "COLUMNS": "160"}


def localllm(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "localllm.cli", *args], env=env,
                          capture_output=True, text=True, timeout=300)


def table_rows(out: str) -> dict[str, str]:
    """FILE -> its row, from the candidates table."""
    rows = {}
    for line in out.splitlines():
        words = line.replace("*", " ").split()
        if words and words[0].startswith("Dense-27B") or words[:1] and words[0].startswith("Qwen"):
            rows[words[0]] = line
    return rows


def picked(out: str) -> str:
    [star] = [line for line in out.splitlines() if line.startswith("*")]
    return star.split()[1]


@pytest.mark.parametrize("card, best, higher", [
    ("rtx3060-12g", "Dense-27B-Q3_K_M.gguf", "Q4_K_M"),
    ("rtx3090", "Dense-27B-Q6_K.gguf", "Q8_0"),
])
def test_the_pick_is_the_best_quant_that_fits_on_the_gpu(store, env, hub, card, best, higher):
    result = localllm("pull", f"hf.co/{DENSE}", "--card", card, "--dry-run", env=env)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    rows = table_rows(out)
    # One candidate per model: the split Q8_0 is one row, the projector none.
    assert sorted(rows) == sorted([f"Dense-27B-{q}.gguf" for q in QUANTS] + ["Dense-27B-Q8_0"])
    assert picked(out) == best
    assert "whole" in rows[best] and "whole" not in rows[
        next(k for k in rows if higher in k)]
    line = next(x for x in out.splitlines() if x.startswith("picked "))
    assert "fits wholly on the GPU" in line and f"{higher} (" in line
    assert "dry run: nothing downloaded" in out
    assert store.list() == []
    # Headers only: a few MiB per file, never the 100 GiB the files add up to.
    assert hub.served_bytes < 6 * 16 * MiB
    assert all(r and r.startswith("bytes=") for r in hub.cdn_requests)


def test_more_vram_never_picks_fewer_bits(env):
    outs = [localllm("pull", f"hf.co/{DENSE}", "--card", c, "--dry-run", env=env).stdout
            for c in ("rtx3060-12g", "rtx4060ti-16g", "rtx3090", "a100-80g")]
    order = ["Q2_K", "Q3_K_M", "Q4_K_M", "Q6_K", "Q8_0"]
    ranks = [next(i for i, q in enumerate(order) if q in picked(o)) for o in outs]
    assert ranks == sorted(ranks) and ranks[-1] == 4  # 80 GiB takes the split Q8_0


def test_when_nothing_fits_whole_enough_quality_then_speed_decides(env):
    """8 GiB: not even Q2_K (8.1 GiB) fits whole. Of the files that run from VRAM and RAM,
    those with at least ENOUGH_BITS count as equally good, and the fastest of them wins: a Q8_0
    read from RAM on every token is not worth a third of the speed."""
    from localllm.cli.quant_pick import ENOUGH_BITS

    out = localllm("pull", f"hf.co/{DENSE}", "--card", "rtx4060", "--dry-run", env=env).stdout
    rows = table_rows(out)
    assert not any("whole" in row for row in rows.values())
    in_ram = [name for name, row in rows.items() if "part" in row and "disk" not in row]
    bits = {name: float(rows[name].split()[-4]) for name in in_ram}
    speed = {name: float(rows[name].split()[-2]) for name in in_ram}
    best = max(in_ram, key=lambda name: (min(bits[name], ENOUGH_BITS), speed[name]))
    assert picked(out) == best
    assert bits[best] >= ENOUGH_BITS or bits[best] == max(bits.values())
    line = next(x for x in out.splitlines() if x.startswith("picked "))
    assert "fits in VRAM and RAM" in line


@pytest.mark.parametrize("args", [
    ["--quant", "Q8_0"], ["--quant", "q8_0"],
])
def test_quant_overrides_the_pick(env, args):
    result = localllm("pull", f"hf.co/{DENSE}", "--card", "rtx3060-12g", "--dry-run", *args,
                      env=env)
    assert result.returncode == 0, result.stderr
    assert picked(result.stdout) == "Dense-27B-Q8_0"
    assert "Q8_0: as asked (--quant)" in result.stdout


def test_colon_quant_form_keeps_working(env):
    result = localllm("pull", f"hf.co/{DENSE}:Q4_K_M", "--card", "rtx3060-12g", "--dry-run",
                      env=env)
    assert result.returncode == 0, result.stderr
    assert picked(result.stdout) == "Dense-27B-Q4_K_M.gguf"


@pytest.mark.parametrize("args, words", [
    ([f"hf.co/{DENSE}", "--quant", "Q5_K_S"],
     "no Q5_K_S GGUF; available: Q2_K, Q3_K_M, Q4_K_M, Q6_K, Q8_0"),
    ([f"hf.co/{DENSE}:Q4_K_M", "--quant", "Q6_K"], "give one"),
    (["hf.co/test/NoModels"], "has no GGUF files"),
    ([f"hf.co/{REPO}/{FILE}", "--quant", "Q4_1"], "--quant applies to"),
    (["27b-q3", "--quant", "Q9_9"], "offers UD-IQ2_XXS"),
    (["smollm2", "--quant", "Q8_0"], "comes in one quant"),
])
def test_errors_are_one_line(store, env, hub, tmp_path, args, words):
    notes = tmp_path / "README.txt"
    notes.write_text("no models here\n")
    hub.add("test/NoModels", "README.txt", notes)
    result = localllm("pull", *args, env=env)
    assert result.returncode == 1, result.stdout
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and words in errors[0], result.stderr
    assert "Traceback" not in result.stderr
    assert store.list() == []


def test_repo_pull_plans_then_downloads_the_pick(store, env, hub, smollm2_gguf):
    """A real pull: the local hub's SmolLM2 repo (one model and a projector) lands verified
    under the repo's own name, so `localllm run hf.co/OWNER/REPO` finds it; the projector is
    no candidate but comes with the pick, as its companion."""
    hub.add(REPO, "mmproj-SmolLM2-f16.gguf", smollm2_gguf)
    result = localllm("pull", f"hf.co/{REPO}", env=env)
    assert result.returncode == 0, result.stderr
    assert "picked Q4_1" in result.stdout
    assert "mmproj" not in result.stdout
    entry = store.get(f"hf.co/{REPO}")
    assert str(entry.name) == "hf.co/test/smollm2-gguf:latest"
    from localllm.modelstore.store import sha256_file

    assert entry.digest == "sha256:" + sha256_file(smollm2_gguf)
    from localllm.modelstore.store import PROJECTOR_LAYER

    assert entry.companion(PROJECTOR_LAYER) is not None


def test_catalog_quants_are_listed_and_picked(env, hub, dense_files):
    listed = localllm("pull", "--list", "--card", "rtx3060-12g", env=env)
    lines = listed.stdout.splitlines()
    at = next(i for i, x in enumerate(lines) if x.split()[:1] == ["27b-q3"])
    assert lines[at + 1].strip().startswith("quants: UD-IQ2_XXS, UD-Q2_K_XL")
    # The catalog's repo on the local hub, with one quant the catalog does not list.
    repo = "unsloth/Qwen3.6-27B-MTP-GGUF"
    names = {"UD-Q2_K_XL": "Dense-27B-Q2_K.gguf", "UD-Q3_K_XL": "Dense-27B-Q3_K_M.gguf",
             "Q4_K_M": "Dense-27B-Q4_K_M.gguf", "Q5_K_S": "Dense-27B-Q6_K.gguf"}
    serve(hub, repo, {f"Qwen3.6-27B-{q}.gguf": dense_files[f] for q, f in names.items()})
    result = localllm("pull", "27b-q3", "--quant", "auto", "--card", "rtx3060-12g",
                      "--dry-run", env=env)
    assert result.returncode == 0, result.stderr
    assert picked(result.stdout) == "Qwen3.6-27B-UD-Q3_K_XL.gguf"
    assert "Q5_K_S" not in result.stdout  # not one of the catalog's quants


async def test_a_header_longer_than_the_first_read_is_read_in_growing_ranges(hub, dense_files,
                                                                             monkeypatch):
    """The first range holds 64 KiB here, far less than the 152k-token vocabulary: the reader
    asks again for twice as much until the header parses, and reads no weights."""
    import aiohttp

    from localllm.modelstore import remote_header
    from localllm.modelstore.gguf_header import read_header
    from localllm.modelstore.hub import HubClient, HubSettings

    monkeypatch.setattr(remote_header, "FIRST_BYTES", 64 << 10)
    serve(hub, DENSE, dense_files)
    source = dense_files["Dense-27B-Q4_K_M.gguf"]
    async with aiohttp.ClientSession() as session:
        client = HubClient(session, HubSettings(hub.url))
        [remote] = [f for f in await client.list_repo(DENSE)
                    if f.filename == "Dense-27B-Q4_K_M.gguf"]
        header, n = await remote_header.read_remote_header(client, remote, "test")
    local = read_header(source)
    assert header.tensors == local.tensors and header.data_offset == local.data_offset
    assert len(hub.cdn_requests) > 2  # it had to grow
    assert local.data_offset <= n < 2 * local.data_offset + (64 << 10)
