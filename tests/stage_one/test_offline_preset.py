"""Stage one with a real preset and no Hub: it fails in seconds, naming the repository, the command that downloads
what the encoders read and --pretrained DIR, and leaves no cache directory behind; a copy in the Hugging Face cache
is used without the Hub."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from precompute.encode import Encoders
from precompute.presets import get_preset, save_tiny, weights_sources
from precompute.sample_data import make_folder

pytestmark = pytest.mark.model  # the cached-copy test builds tiny transformers / diffusers models

ROOT = Path(__file__).resolve().parents[2]
FLUX = "black-forest-labs/FLUX.1-dev"


def assert_names_the_way_out(message: str) -> None:
    assert FLUX in message
    assert (f"hf download {FLUX} --include 'vae/*' 'text_encoder/*' 'tokenizer/*' 'text_encoder_2/*' 'tokenizer_2/*' "
            f"--local-dir DIR") in message, message
    assert "--pretrained DIR" in message


@pytest.fixture
def silent_server():
    """A local address that accepts connections and never answers (a black-holed proxy, a stalled Hub)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    server.close()


@pytest.mark.parametrize("hub", ["refused", "silent"])
def test_a_real_preset_without_the_hub_fails_in_seconds(tmp_path, hub, request):
    endpoint = "http://127.0.0.1:9" if hub == "refused" else request.getfixturevalue("silent_server")
    data = make_folder(tmp_path / "data", count=2)
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env.update(HF_ENDPOINT=endpoint, HF_HOME=str(tmp_path / "hf"), HF_HUB_ETAG_TIMEOUT="2")
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "precompute", str(data), "--model", "flux-dev", "--cache",
                          str(tmp_path / "new" / "cache")], cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    elapsed = time.perf_counter() - t0
    assert out.returncode == 2, out.stderr[-3000:]
    assert_names_the_way_out(out.stderr)
    assert "Retrying" not in out.stderr  # asked once, not through the download's retries
    assert elapsed < 60, elapsed  # the imports take most of it on a busy machine; the Hub at most its 2 s timeout
    assert not (tmp_path / "new").exists()
    assert not (tmp_path / "hf").exists() or not any((tmp_path / "hf").rglob("models--*"))  # nothing half-downloaded


def test_offline_without_a_cached_copy_names_the_way_out():
    assert os.environ["HF_HUB_OFFLINE"] == "1"  # conftest
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE is set") as e:
        weights_sources(get_preset("flux-dev"))
    assert_names_the_way_out(str(e.value))
    assert weights_sources(get_preset("tiny-flux")) == {}  # nothing to load from anywhere


def test_a_copy_in_the_hugging_face_cache_loads_without_the_hub(tmp_path, monkeypatch):
    """The snapshot `hf download` leaves in the Hugging Face cache (here: the tiny components in flux-dev's layout)."""
    from huggingface_hub import constants

    repo = tmp_path / "hub" / f"models--{FLUX.replace('/', '--')}"
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    save_tiny(get_preset("tiny-flux"), repo / "snapshots" / commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    preset = get_preset("flux-dev")
    assert weights_sources(preset) == {FLUX: str(repo / "snapshots" / commit)}
    enc = Encoders(preset, torch.device("cpu"))
    assert enc.fingerprint()["vae"]["source"] == FLUX  # the cache records the repository, not where it was read
    tiny = Encoders(get_preset("tiny-flux"), torch.device("cpu"))
    pixels = torch.randint(0, 256, (1, 3, 32, 32), dtype=torch.uint8)
    assert torch.equal(enc.encode_images(pixels)["latent_mean"], tiny.encode_images(pixels)["latent_mean"])
