"""Presets: which VAE and text encoder a cache is built with, looked up by name in the families' registry.

Stage two has presets of the same names for the transformer it trains. Real presets load
published weights with `from_pretrained` (a Hub id or a local directory in the diffusers layout);
`tiny-*` presets build the same classes from small configs with seeded random weights, so the
whole path runs offline on a CPU in seconds.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from precompute import families
from precompute.families.base import Preset, TextEncoderSpec


def real_first(names: list[str]) -> list[str]:
    """Published models before the tiny ones, each group in the registry's order."""
    return [n for n in names if not n.startswith("tiny-")] + [n for n in names if n.startswith("tiny-")]


def preset_names() -> list[str]:
    """Every preset's name, as --help and the errors list them."""
    return real_first([name for f in families.FAMILIES for name in f.presets()])


def text_encoder_names() -> list[str]:
    """Every text encoder `--text-encoder` may name."""
    return real_first([name for f in families.FAMILIES for name in f.text_encoders()])


def get_preset(name: str) -> Preset:
    for f in families.FAMILIES:
        if name in (presets := f.presets()):
            return presets[name]
    raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(preset_names())}")


def get_text_encoder(name: str) -> TextEncoderSpec:
    for f in families.FAMILIES:
        if name in (encoders := f.text_encoders()):
            return encoders[name]
    raise ValueError(f"unknown text encoder {name!r}; choose one of {', '.join(text_encoder_names())}")


def weights_sources(preset: Preset, pretrained: str | None = None, vae: bool = True) -> dict[str, str]:
    """Where the preset's encoders load from when the Hub cannot be reached: {repository: its snapshot in the Hugging
    Face cache}. A repository the Hub answers for is left to `from_pretrained` (which downloads what it needs), and so
    is a local directory. The Hub is asked once per repository with huggingface_hub's short timeout (HF_HUB_ETAG_TIMEOUT,
    10 s by default), never with the download's retries; with HF_HUB_OFFLINE it is not asked.

    Raises:
        ValueError: a repository is neither reachable nor cached, or the Hub does not have it; the message names the
            repository, the command that downloads what the encoders read, and --pretrained DIR.
    """
    text_folders = [f for pair in families.family(preset.text.family).text_subfolders(preset.text) for f in pair]
    sides = [(preset.vae.repo, preset.vae.revision, [preset.vae.subfolder])] if vae else []
    if vae and (image := preset.image_encoder) is not None:  # an image-to-video preset's first-frame encoder
        sides.append((image.repo, image.revision, [image.subfolder, image.processor_subfolder]))
    sides.append((preset.text.repo, preset.text.revision, text_folders))
    wanted: dict[tuple[str, str | None], list[str]] = {}  # the folders each repository is read for
    for repo, revision, folders in sides:
        repo = pretrained or repo
        if repo is not None and not Path(repo).expanduser().is_dir():
            wanted.setdefault((repo, revision), []).extend(f for f in folders if f not in wanted.get((repo, revision), []))
    found, missing, reason = {}, [], ""
    for (repo, revision), folders in wanted.items():
        reason = _unreachable(repo, revision)
        if reason is None:
            continue
        copy = _cached_snapshot(repo, revision, folders)
        if copy is None:
            missing.append((repo, revision, folders))
        else:
            found[repo] = copy
    if missing:
        names = ", ".join(f"{repo} (revision {revision or 'main'})" for repo, revision, _ in missing)
        commands = "\n".join(f"  hf download {repo}" + (f" --revision {revision}" if revision else "")
                             + " --include " + " ".join(f"'{f}/*'" for f in folders) + " --local-dir DIR"
                             for repo, revision, folders in missing)
        raise ValueError(f"cannot load the encoders of {preset.name}: {reason}, and the Hugging Face cache holds no copy of "
                         f"{names}. Download them where the Hub is reachable (huggingface-cli download takes the same "
                         f"arguments):\n{commands}\nand pass --pretrained DIR.")
    return found


def _unreachable(repo: str, revision: str | None) -> str | None:
    """Why the Hub cannot serve `repo` now (None: it can); a repository or revision it does not have is an error."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    try:
        HfApi().model_info(repo, revision=revision, timeout=constants.HF_HUB_ETAG_TIMEOUT)
    except RevisionNotFoundError:
        raise ValueError(f"{repo} has no revision {revision!r} on the Hub; check --revision, or pass --pretrained DIR "
                         f"for a local copy") from None
    except RepositoryNotFoundError:
        raise ValueError(f"{repo} was not found on the Hub (or is private: log in with hf auth login); check the id, "
                         f"or pass --pretrained DIR for a local copy") from None
    except Exception as e:  # no network, no DNS, a timeout, a proxy's error page: all mean the same here
        return f"the Hub is unreachable ({type(e).__name__}: {e})"
    return None


def _cached_snapshot(repo: str, revision: str | None, folders: list[str]) -> str | None:
    """The snapshot of `repo` in the Hugging Face cache, if it holds every one of `folders`."""
    from huggingface_hub import snapshot_download

    try:
        path = Path(snapshot_download(repo, revision=revision, local_files_only=True))
    except Exception:  # nothing cached for this repository or revision
        return None
    return str(path) if all((path / f).is_dir() for f in folders) else None


def save_tiny(preset: Preset, directory) -> None:
    """Write a tiny preset's components in the diffusers layout, to load back with `from_pretrained` (--pretrained)."""
    families.family(preset.family).save_tiny_vae(preset.vae, str(directory))
    families.family(preset.family).save_tiny_first_frame(preset, str(directory))
    families.family(preset.text.family).save_tiny_text(preset.text, str(directory))


def weights_digest(module: torch.nn.Module, samples: int = 4096) -> str:
    """A cheap digest of a module's weights: names, shapes, dtypes and evenly spaced values.

    Hashing every byte of a large text encoder would cost tens of seconds per run; any two distinct checkpoints
    differ at sampled positions, which is what the fingerprint needs.
    """
    h = hashlib.sha256()
    for name, t in sorted(module.state_dict().items()):
        flat = t.detach().reshape(-1)
        step = max(1, flat.numel() // samples)
        picked = flat[::step][:samples].to("cpu", torch.float64)
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}|".encode())
        h.update(picked.numpy().tobytes())
    return h.hexdigest()
