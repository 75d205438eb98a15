"""The transformer a run trains: where its weights come from (released, local, fresh) and how it is built and called.

Presets themselves belong to their families (`train.families`): real presets start from the published weights
(`from_pretrained`, subfolder `transformer`) or, with `--from-scratch`, build the published architecture
(`train/configs/*.json`) with fresh weights; `tiny-*` presets are the same classes at CPU size.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import torch

from train import families
from train.families.base import ModelPreset


@dataclass(frozen=True)
class Weights:
    """Where a run's transformer weights come from, as the start-up log and the checkpoints record it.

    Args:
        kind: "hub" (a Hub repository, resolved to a local snapshot), "local" (a directory) or "fresh"
            (random initialisation from the config, seeded).
        source: the Hub id or the directory; for "fresh", what was initialised.
        revision: the Hub revision asked for (None: the default branch).
        commit: the Hub commit the snapshot holds.
        path: the local directory `from_pretrained` reads (the snapshot, or `source`).
    """

    kind: Literal["hub", "local", "fresh"]
    source: str
    revision: str | None = None
    commit: str | None = None
    path: str | None = None

    def describe(self) -> str:
        if self.kind == "hub":
            return f"{self.source} (revision {self.revision or 'main'}, commit {self.commit or 'unknown'})"
        if self.kind == "local":
            return f"local directory {self.source}"
        return self.source

    def to_json(self) -> dict:
        return {"kind": self.kind, "source": self.source, "revision": self.revision, "commit": self.commit}


def resolve_weights(preset: ModelPreset, pretrained: str | None = None, revision: str | None = None,
                    from_scratch: bool = False, seed: int = 0) -> Weights:
    """The weights a run starts from: `pretrained` (a directory or Hub id), else the preset's released
    weights; fresh seeded ones for tiny presets or with `from_scratch`.

    A Hub id is resolved to a local snapshot first (downloading `transformer/` only, or finding it in the
    Hugging Face cache when offline), so an unreachable Hub fails at once with what to do, never hangs.
    """
    if from_scratch or (pretrained is None and preset.repo is None):
        what = "the published config" if preset.repo else f"the {preset.name} config"
        return Weights("fresh", f"fresh weights from {what} (seed {seed})")
    source = pretrained or preset.repo
    local = Path(source).expanduser()
    if local.is_dir():
        return Weights("local", str(local.resolve()), path=str(local.resolve()))
    if pretrained and (pretrained.startswith((".", "/", "~")) or pretrained.count("/") != 1):
        raise ValueError(f"--pretrained {pretrained}: no such directory (a Hub id has the form owner/name)")
    revision = revision or (preset.revision if source == preset.repo else None)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    local_copy = (f"Download it where the Hub is reachable (huggingface-cli download {source} --include '{preset.subfolder}/*' "
                  f"--local-dir DIR) and pass --pretrained DIR, or train from random initialisation with --from-scratch.")
    try:
        folders = preset.experts if preset.paired else (preset.subfolder,)  # both experts of a two-expert model, or one
        path = snapshot_download(source, revision=revision, allow_patterns=[f"{folder}/*" for folder in folders])
    except GatedRepoError:
        raise ValueError(f"{source} is gated on the Hub: accept its licence on huggingface.co and log in "
                         f"(huggingface-cli login), or {local_copy[0].lower()}{local_copy[1:]}") from None
    except (RepositoryNotFoundError, RevisionNotFoundError) as e:
        raise ValueError(f"{source} (revision {revision or 'main'}) was not found on the Hub ({type(e).__name__}); check the "
                         f"id, or pass --pretrained DIR for a local copy") from None
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as e:
        raise ValueError(f"cannot load the transformer of {source} (revision {revision or 'main'}): the Hub is unreachable or "
                         f"offline and no copy is in the Hugging Face cache ({type(e).__name__}). {local_copy}") from None
    return Weights("hub", source, revision, commit=Path(path).name, path=path)


def build_transformer(preset: ModelPreset, weights: Weights | str | None, seed: int,
                      dtype: torch.dtype = torch.float32, quant: str | None = None) -> torch.nn.Module:
    """The transformer in `dtype`: from `weights` (a `resolve_weights` result, or a directory or Hub id),
    or fresh seeded weights from the preset's config when `weights` is None or fresh. `quant` ("int8", "fp8",
    "nf4"; None: none): its Linear weights quantized as they load (`train.quant`), the rest in bf16. A `paired` preset:
    both experts of a two-expert model as one `train.experts.Experts` (fresh ones seeded `seed` and `seed + 1`)."""
    from train import quant as quantization

    if preset.paired:
        from train.experts import Experts

        high, low = (build_transformer(replace(preset, subfolder=folder, paired=False), weights, seed + i, dtype, quant)
                     for i, folder in enumerate(preset.experts))
        return Experts(high, low, preset.expert_boundary * 1000, preset.experts)
    cls = preset.transformer_class
    if isinstance(weights, str):
        weights = resolve_weights(preset, weights)
    if weights is not None and weights.kind != "fresh":
        path = Path(weights.path)
        subfolder = preset.subfolder if (path / preset.subfolder).is_dir() or not (path / "config.json").exists() else None
        if quant:
            return quantization.load(cls, path, subfolder, quant)
        return cls.from_pretrained(path, subfolder=subfolder, torch_dtype=dtype)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls.from_config(preset.transformer_config())
    if quant:
        return quantization.quantize_fresh(model, quant)
    return model if dtype == torch.float32 else model.to(dtype)


def model_forward(model, family: str, guidance: float | None = None):
    """The family's call signature as (noisy latents, timesteps, batch) -> prediction (`Family.forward`).
    `guidance`: the value of a guidance-distilled model's guidance embedding (models without one take none)."""
    config = getattr(model, "module", model).config  # through a DDP wrapper
    kind = families.get_family(family)

    def fn(xt, t, batch):
        return kind.forward(model, config, xt, t, batch, guidance)
    return fn


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks in order of a family's transformer or ControlNet (`Family.blocks`); of two experts, the
    first's then the second's."""
    from train.experts import Experts

    if isinstance(model, Experts):
        return [block for expert in model.experts for block in transformer_blocks(expert)]
    return families.family_of_module(model).blocks(model)


def load_saved(preset: ModelPreset, directory: Path, dtype: torch.dtype | None = None, **kwargs) -> torch.nn.Module:
    """The transformer a checkpoint or export saved at `directory` (its `transformer/` folder; both experts' for a
    `paired` preset); `kwargs` go to `from_pretrained`."""
    if preset.paired:
        from train.experts import Experts

        return Experts.from_pretrained(preset.transformer_class, directory, preset.expert_boundary * 1000, preset.experts,
                                       torch_dtype=dtype, **kwargs)
    return preset.transformer_class.from_pretrained(directory, torch_dtype=dtype, **kwargs)

