"""What the format fuzz writes and checks against: its samples and prompts, what one generation holds (`State`),
and what a reader of a generation gets, compared with it."""

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shards import Cache, Field, FormatError, Prompt
from shards.schema import sample_digest

SCHEMA = {"latent": Field(torch.bfloat16), "text": Field(torch.bfloat16, ragged=True), "size": Field(torch.int32)}
PROMPT_SCHEMA = {"text": SCHEMA["text"]}
FINGERPRINT = {"vae": {"id": "fuzz-vae"}, "text_encoder": {"id": "fuzz-t5"}}


class Broken(AssertionError):
    """An invariant does not hold."""


def fields_of(n: int, bucket: tuple[int, int]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return {"latent": torch.randn(2, bucket[0] // 8, bucket[1] // 8, generator=g).bfloat16(),
            "text": torch.randn(n % 4, 8, generator=g).bfloat16(),
            "size": torch.tensor([bucket[0] + n, bucket[1]], dtype=torch.int32)}


def prompt_of(m: int) -> Prompt:
    g = torch.Generator().manual_seed(10_000 + m)
    return Prompt(f"prompt {m}", {"text": torch.randn(1 + m % 3, 8, generator=g).bfloat16()})


def prompt_digest(key: str, p: Prompt) -> bytes:
    return hashlib.sha256(sample_digest(key, p.fields) + p.text.encode()).digest()


@dataclass(frozen=True)
class State:
    """What one generation holds: key -> (digest, dataset, source, stamp), and prompt key -> digest."""

    samples: dict = field(default_factory=dict)
    prompts: dict = field(default_factory=dict)


def refusal(e: BaseException, root: Path) -> bool:
    """Whether `e` is the library refusing a cache it cannot read: its error types, with a message naming the cache."""
    library = isinstance(e, FormatError) or (type(e) is FileNotFoundError and not str(e).startswith("[Errno"))
    if library and str(root) not in str(e):
        raise Broken(f"the refusal does not name the cache or the file: {type(e).__name__}: {e}")
    return library


def read(root: Path, generation: int | None = None, full: bool = True) -> tuple[int, State]:
    """What a reader of `generation` (default: the newest) gets: the sample index and prompts, and with `full` each
    sample through `Cache` with its stored digest checked (without, a sample's digest in the result is None)."""
    cache = Cache(root, generation, check_digests=True)
    datasets = cache.manifest.shards.datasets()
    index = list(cache.manifest.samples())
    if len(index) != len(cache):
        raise Broken(f"the sample index lists {len(index)} samples, the shards hold {len(cache)}")
    out = {}
    for i, (key, source, stamp, j, _) in enumerate(index):
        digest = None
        if full:
            sample = cache[i]
            if sample.key != key:
                raise Broken(f"sample {i} is {sample.key} in {cache.path(j)}, the sample index says {key}")
            digest = sample_digest(sample.key, sample.fields)
        if key in out:
            raise Broken(f"{key} is listed twice")
        out[key] = (digest, datasets[j], source, stamp)
    return cache.generation, State(out, {k: prompt_digest(k, p) for k, p in cache.prompts().items()})


def blind(state: State) -> State:
    """`state` without its sample digests, as `read(full=False)` sees it."""
    return State({k: (None, *v[1:]) for k, v in state.samples.items()}, state.prompts)


def difference(got: State, want: State) -> str:
    missing, extra = sorted(want.samples.keys() - got.samples.keys()), sorted(got.samples.keys() - want.samples.keys())
    changed = sorted(k for k in want.samples.keys() & got.samples.keys() if want.samples[k] != got.samples[k])
    prompts = "" if got.prompts == want.prompts else f", prompts {sorted(got.prompts)} for {sorted(want.prompts)}"
    return f"missing {missing[:5]}, extra {extra[:5]}, changed {changed[:5]}{prompts}"
