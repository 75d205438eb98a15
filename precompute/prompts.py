"""`python -m precompute prompts CACHE --prompt TEXT`: add prompt embeddings to a cache without its dataset.

Training samples validation images from prompts the cache holds (it has no text encoder). Stage one caches
its `--validation-prompt`s, but re-running it to add one needs DATA and a scan of it. This loads only the text
encoder(s) the cache was built with, as the cache's manifest records them (preset, text encoder, token limit,
dropped T5, dtypes, weights), refuses one that differs, encodes the prompts as stage one does
(`precompute.run.store_prompts`) and commits them beside the ones already stored, under the cache's lock.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from precompute.config import DTYPE_HELP, LONG_DTYPES, DtypeOption
from precompute.distributed import lock_cache
from precompute.encode import Encoders, best_device, check_text_encoder
from precompute.families.base import Preset
from precompute.presets import get_preset, get_text_encoder
from precompute.run import store_prompts
from shards import Manifest, ShardWriter, TextSpec, exists, load, prompt_key
from shards.options import check_choices, opt
from shards.prompts import stored_prompts
from shards.schema import dtype_from_name


@dataclass
class PromptsConfig:
    """Every option of `python -m precompute prompts`; the CLI is built from it."""

    cache: Path = field(metadata={"help": "A cache built by `python -m precompute` (its dataset is not needed)."})
    prompt: list[str] = opt([], "A prompt to encode (repeatable), as --validation-prompt encodes it; training and `train sample` "
                                "look it up by this exact text.")
    prompt_file: Path | None = opt(None, "A file of prompts, one per line (added to --prompt; lines stripped, blank ones skipped).")
    pretrained: str | None = opt(None, "Local directory (diffusers layout) or Hub id to load the text encoder(s) from, as stage one's "
                                       "--pretrained (default: where the cache's fingerprint says they came from); a copy of the same "
                                       "weights elsewhere is accepted, other weights or tokenizers are refused.")
    text_dtype: DtypeOption | None = opt(None, f"Text-encoder compute dtype: {DTYPE_HELP} (default: the one the cache was built "
                                               f"with; another is refused, since it changes the embeddings).")

    def __post_init__(self) -> None:
        self.text_dtype = LONG_DTYPES.get(self.text_dtype, self.text_dtype)
        check_choices(self)
        self.cache = Path(self.cache)
        prompts = list(self.prompt)
        if self.prompt_file is not None:
            try:
                lines = Path(self.prompt_file).read_text(encoding="utf-8").splitlines()
            except (OSError, UnicodeDecodeError) as e:
                raise ValueError(f"--prompt-file {self.prompt_file}: {e}") from None
            prompts += [line.strip() for line in lines if line.strip()]
            self.prompt_file = None  # read once, as PrecomputeConfig reads --validation-file
        if "" in prompts:
            # store_prompts encodes the empty caption without the family's instruction prompt (the guidance
            # embedding); a prompt "" would overwrite it with the instruction's
            raise ValueError("--prompt '': the empty caption is always cached (for guidance); give non-empty prompts")
        self.prompt = list(dict.fromkeys(prompts))  # in order, each once


def cached_text_encoder(manifest: Manifest, root: Path) -> tuple[Preset, str | None, str | None]:
    """The preset, text-encoder compute dtype and `--pretrained` the cache's text side was built with, read from
    stage one's record (the preset) and the fingerprint's `text_encoder` part (the encoder, its token limit,
    a dropped T5, the dtype and where the weights came from)."""
    record = manifest.extra.get("precompute") or {}
    text = manifest.fingerprint.get("text_encoder")
    if not record.get("preset") or not isinstance(text, dict) or "name" not in text:
        raise ValueError(f"{root} records no stage-one preset or text encoder in its manifest (it was not built by "
                         f"`python -m precompute`); re-run stage one on its DATA with --validation-prompt instead")
    preset = get_preset(record["preset"])
    # the preset's own encoder may name its repository (a preset whose text encoder ships with its transformer), which
    # get_text_encoder(name) would not
    spec = preset.text if text["name"] == preset.text.name else get_text_encoder(text["name"])
    layout = TextSpec.from_fingerprint(text)
    preset = replace(preset, text=replace(spec, max_length=layout.max_tokens, drop_t5=layout.t5_zeros > 0))
    source = text.get("source")
    pretrained = None if source in (spec.repo, f"{spec.name} (seeded)") else source  # Encoders' text_source
    return preset, LONG_DTYPES.get(text.get("compute_dtype")), pretrained


def add_prompts(config: PromptsConfig) -> dict:
    """Encode `config.prompt` into the cache's prompt store; prompts already there are kept and not encoded again.

    Returns:
        {"added": [texts], "cached": [texts already stored]}.

    Raises:
        FileNotFoundError: `config.cache` holds no cache.
        CacheBusy: another run is writing the cache.
        ValueError: a cache not built by stage one, or a text encoder that differs from the cache's.
    """
    cache = config.cache
    if not exists(cache):
        raise FileNotFoundError(f"{cache} holds no cache; build it with `python -m precompute DATA --cache {cache}`")
    lock = lock_cache(cache, rank=0, world=1)
    try:
        manifest = load(cache)  # under the lock: the prompts stored now are the ones this run merges into
        stored, problem = stored_prompts(cache, manifest.files.get("prompts"))
        if problem:  # the empty caption and the prompts given are encoded afresh into a new file
            print(f"warning: {problem}")
        cached = [p for p in config.prompt if prompt_key(p) in stored]
        added = [p for p in config.prompt if prompt_key(p) not in stored]
        if not added and prompt_key("") in stored:
            return {"added": [], "cached": cached}  # nothing to encode: the text encoder is not even loaded

        preset, text_dtype, pretrained = cached_text_encoder(manifest, cache)
        enc = Encoders(preset, best_device(), text_dtype=config.text_dtype or text_dtype,
                       pretrained=config.pretrained or pretrained, vae=False)
        check_text_encoder(manifest.fingerprint["text_encoder"], enc.text_fingerprint(), cache)
        storage = dtype_from_name(manifest.fingerprint["storage_dtype"])
        with ShardWriter(cache, manifest.fingerprint, manifest.schema, text_schema=manifest.text_schema) as writer:
            store_prompts(writer, enc, added, storage)
    finally:
        lock.release()
    return {"added": added, "cached": cached}

