"""TREAD token routing (Krause et al. 2025, "Token Routing for Efficient Architecture-agnostic Diffusion Training"):
in a training forward, a random share of the image tokens skips a range of transformer blocks.

A route `RATIO:START:END` takes `RATIO` of the image tokens out of the sequence before block START and puts them back
at their positions after block END (both included; negative indices count from the end, -1 is the last block), as
they were before START: the blocks between process the kept tokens alone, fewer by RATIO, which is where the time goes.
Several routes (comma-separated) must not overlap. Only what the family's `TokenRoute` names is routed, image tokens:
text tokens never (they are another stream, or another argument), nor an edit's reference tokens (`Family.tread_tokens`).
The positions of the kept tokens go with them: a rotary embedding's rows are gathered for them (`TokenRoute.per_token`);
absolute position embeddings were added before the first block.

Routing happens in a training forward only (gradients on, the transformer in train mode, after `Router.at` seeded the
step): the held-out loss, validation, output preservation's target and export see every token. The selection is drawn
from a generator seeded by the run's seed, the step, the micro-batch and the rank, so a resumed run routes exactly as
an uninterrupted one.

With --masked-loss, the tokens the loss weights (a patch of the loss mask with any weight above 0) are never routed:
they are kept first, and random others among the rest are routed until RATIO of all image tokens are; where a sample's
weighted tokens outnumber the 1 - RATIO kept share, fewer are routed (the same count for every sample of a call: the
most any sample must keep). A family whose selection is one for the whole call (`TokenRoute.shared`: one rotary table
per call) keeps the tokens any sample of the call weights. That count is a size the host must know: it is counted on the
batch's loss masks in host memory (`LOSS_MASKS`, which the loader's collate carries beside the masks it copies to the
device), so routing waits for the device no more than a step without it does. A batch built without them (not by the
loader) reads the count from the device instead, once per routed call.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from train.families.base import LOSS_MASKS
from train.order import seeded_generator

SALT = 3_000_017  # the routing draws' seed part, apart from the objective's (1_000_003) and the optimizer's (2_000_003)
SYNTAX = "RATIO:START:END[,RATIO:START:END...]"


@dataclass(frozen=True)
class Route:
    """One route: `ratio` of the image tokens skip blocks `start` to `end` (both included; negative: from the end)."""

    ratio: float
    start: int
    end: int

    def __str__(self) -> str:
        return f"{self.ratio:g}:{self.start}:{self.end}"

    def resolve(self, depth: int) -> tuple[int, int]:
        """(start, end) as block indices of a transformer of `depth` blocks."""
        start, end = (i + depth if i < 0 else i for i in (self.start, self.end))
        if not (0 <= start < depth and 0 <= end < depth):
            raise ValueError(f"--tread {self}: the transformer has {depth} blocks (indices 0 to {depth - 1}, or -1 to "
                             f"-{depth} from the end); choose START and END among them")
        if end < start:
            raise ValueError(f"--tread {self}: block {end} comes before block {start}; a route runs from START to END")
        return start, end


def parse_routes(text: str) -> tuple[Route, ...]:
    """`--tread`'s value: routes `RATIO:START:END`, comma-separated ("" or "off": none)."""
    if text.strip().lower() in ("", "off", "none"):
        return ()
    routes = []
    for part in text.split(","):
        fields = part.strip().split(":")
        try:
            if len(fields) != 3:
                raise ValueError
            route = Route(float(fields[0]), int(fields[1]), int(fields[2]))
        except ValueError:
            raise ValueError(f"--tread {text!r}: {part.strip()!r} is not a route; write {SYNTAX}, e.g. 0.5:2:-2 (half the "
                             f"image tokens skip block 2 to the second-to-last)") from None
        if not 0 <= route.ratio < 1:
            raise ValueError(f"--tread {route}: the ratio is the share of image tokens routed past the blocks, in [0, 1)")
        routes.append(route)
    return tuple(routes)


def resolve_routes(routes: tuple[Route, ...], depth: int) -> list[tuple[float, int, int]]:
    """(ratio, start, end) block indices of each route, in order, checked not to overlap."""
    resolved = sorted((r.resolve(depth), r) for r in routes)
    for (a, ra), (b, rb) in zip(resolved, resolved[1:]):
        if b[0] <= a[1]:
            raise ValueError(f"--tread: routes {ra} and {rb} overlap (blocks {a[0]}-{a[1]} and {b[0]}-{b[1]}); a token "
                             f"leaves the sequence once per route: let one end before the next starts")
    return [(r.ratio, start, end) for (start, end), r in resolved]


def token_mask(mask: torch.Tensor, patch: int) -> torch.Tensor:
    """The tokens a loss mask weights: (B, 1, h, w) (a clip's (B, 1, T, h, w)) -> (B, tokens) bool, True where any
    latent cell of the token's patch (patch x patch; tokens row-major, as patch embeddings and 2 x 2 packing order
    them) has a weight above 0."""
    weighted = (mask > 0).float()
    if weighted.dim() == 5:
        pooled = F.max_pool3d(weighted, (1, patch, patch))
    else:
        pooled = F.max_pool2d(weighted, patch)
    return pooled.flatten(1) > 0


def host_token_mask(batch: Mapping, patch: int) -> torch.Tensor | None:
    """`token_mask` of the batch's loss masks in host memory (`LOSS_MASKS`, one (1, h, w) per sample), computed on the
    host; None for a batch without them."""
    masks = batch.get(LOSS_MASKS)
    if masks is None:
        return None
    return token_mask(torch.stack(list(masks)), patch)


def select(scores: torch.Tensor, keep: torch.Tensor | None, ratio: float, least: int | None = None) -> torch.Tensor:
    """Positions of the kept tokens, ascending: (rows, K) of `scores` (rows, N) uniform draws, the K lowest kept, K =
    N - round(N x ratio) or, with `keep` (rows, N) (tokens never routed), at least `least`, the most any row must keep
    (counted on the host; None: read from `keep`, which waits for the device)."""
    n = scores.shape[1]
    count = n - round(n * ratio)
    if keep is not None:
        if least is None:
            least = int(keep.sum(dim=1).max())  # a data-dependent size read from the device
        count = max(count, least)
        scores = scores.masked_fill(keep, -1.0)  # below every draw: kept first
    return scores.topk(count, dim=1, largest=False).indices.sort(dim=1).values


@dataclass
class _Open:
    """A route inside one transformer call: the sequence before its first block, the kept positions, and the blocks'
    per-token arguments for those (rebuilt from the first block's arguments)."""

    before: torch.Tensor  # (B, S, D)
    kept: torch.Tensor  # (B | 1, K) ascending, among the S tokens
    replaced: dict


class Router:
    """Routes the image tokens of a transformer's blocks (`install` builds it and wraps the blocks); inert outside a
    training forward.

    Args:
        routes: (ratio, start, end) per route, resolved (`resolve_routes`).
        seed: the run's seed; `at` seeds each micro-batch's draws from it.
        rank: this process's rank (its samples differ from the other ranks').
        modules: the transformer (or each of two experts): routing only while they are in train mode.
        tokens: (noisy latents) -> how many tokens at the front of the blocks' image sequence may be routed (None:
            all; an edit's reference tokens follow the target's).
        keep: (batch) -> (B, tokens) bool, the tokens never routed (None: any may be).
        keep_host: (batch) -> the same on the host, or None when the batch has no host copy of what `keep` reads
            (the count of kept tokens is then read from the device).
    """

    def __init__(self, routes: list[tuple[float, int, int]], *, seed: int, rank: int, modules: list[torch.nn.Module],
                 tokens: Callable | None = None, keep: Callable | None = None, keep_host: Callable | None = None):
        self.routes, self.seed, self.rank, self.modules = routes, seed, rank, modules
        self.tokens_of, self.keep_of, self.keep_host_of = tokens, keep, keep_host
        self.generator: torch.Generator | None = None
        self.call: dict | None = None  # the current transformer call's: routable tokens, keep mask; None: not inside one
        self.open: dict[int, _Open] = {}  # route index -> its state within the current call

    def at(self, step: int, micro: int, device: torch.device) -> None:
        """Seed the draws of micro-batch `micro` of step `step` (the training step calls it before each forward)."""
        self.generator = seeded_generator(self.seed, SALT, step, micro, self.rank, device=device)

    def active(self) -> bool:
        """Routing now: a training forward (gradients on, train mode) inside `calling`, after `at`."""
        return (self.generator is not None and torch.is_grad_enabled() and self.call is not None
                and all(m.training for m in self.modules))

    def forward(self, forward: Callable) -> Callable:
        """The run's forward (xt, t, batch) -> prediction with this router told each call's routable tokens and kept
        ones."""
        def routed(xt: torch.Tensor, t: torch.Tensor, batch: dict) -> torch.Tensor:
            with self.calling(xt, batch):
                return forward(xt, t, batch)
        return routed

    @contextlib.contextmanager
    def calling(self, xt: torch.Tensor, batch: Mapping):
        """Inside it, the blocks route the tokens of this call (noisy latents `xt`, the run's `batch`)."""
        keep = self.keep_of(batch) if self.keep_of else None
        self.call = {"tokens": self.tokens_of(xt) if self.tokens_of else None, "keep": keep,
                     "host": self.keep_host_of(batch) if keep is not None and self.keep_host_of else None}
        try:
            yield
        finally:
            self.call, self.open = None, {}

    def draw(self, hidden: torch.Tensor, ratio: float, shared: bool) -> torch.Tensor:
        """The kept positions (B | 1, K) of a block's sequence `hidden` (B, S, D), ascending: the routable tokens' kept
        ones, then every token after them (an edit's reference tokens)."""
        b, s = hidden.shape[:2]
        n = self.call["tokens"] or s
        keep, host, least = self.call["keep"], self.call["host"], None
        if keep is not None:
            keep = keep.to(hidden.device)
            if keep.shape != (b, n):
                if keep.shape[1] != n:
                    raise ValueError(f"--tread with --masked-loss: the loss mask covers {keep.shape[1]} tokens, the "
                                     f"transformer's blocks route {n}")
                shared = True  # a call on some of the batch's samples: keep what any of them weights
            if host is not None and host.shape != keep.shape:
                raise ValueError(f"--tread with --masked-loss: the batch's loss masks in host memory cover "
                                 f"{tuple(host.shape)} tokens, those on the device {tuple(keep.shape)}")
            if shared:
                keep = keep.any(dim=0, keepdim=True)
            if host is not None:  # the most any row keeps, counted on the host: no wait for the device
                least = int((host.any(dim=0, keepdim=True) if shared else host).sum(dim=1).max())
        rows = 1 if shared else b
        gen = self.generator
        scores = torch.rand(rows, n, generator=gen, device=gen.device).to(hidden.device)
        kept = select(scores, keep, ratio, least)
        if n < s:
            rest = torch.arange(n, s, device=hidden.device).expand(rows, s - n)
            kept = torch.cat([kept, rest], dim=1)
        return kept


def gather_tokens(x: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """Tokens `kept` (B | 1, K) of `x` (B, S, ...) along dim 1 -> (B, K, ...)."""
    index = kept.expand(x.shape[0], -1).reshape(x.shape[0], -1, *[1] * (x.dim() - 2)).expand(-1, -1, *x.shape[2:])
    return x.gather(1, index)


def scatter_tokens(before: torch.Tensor, kept: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
    """`before` (B, S, D) with positions `kept` (B | 1, K) replaced by `routed` (B, K, D): the routed tokens return to
    their places as they were."""
    index = kept.expand(before.shape[0], -1)[..., None].expand(-1, -1, before.shape[-1])
    return before.scatter(1, index, routed.to(before.dtype))


def _block_forward(router: Router, spec, index: int, ratio: float, first: bool, last: bool, block: torch.nn.Module,
                   forward: Callable) -> Callable:
    """Block `block`'s forward inside route `index`: the first block of a route draws the kept tokens and gathers
    them (and the per-token arguments), every block takes the kept tokens, the last puts the routed ones back."""
    signature = inspect.signature(type(block).forward)

    def routed(*args, **kwargs):
        if not (router.active() and (first or index in router.open)):
            return forward(*args, **kwargs)
        bound = signature.bind(block, *args, **kwargs)
        arguments = bound.arguments
        if first:
            hidden = arguments[spec.hidden]
            kept = router.draw(hidden, ratio, spec.shared)
            replaced = spec.per_token(arguments, kept) if spec.per_token else {}
            router.open[index] = _Open(hidden, kept, replaced)
            arguments[spec.hidden] = gather_tokens(hidden, kept)
        state = router.open[index]
        arguments.update(state.replaced)
        out = forward(*bound.args[1:], **bound.kwargs)
        if not last:
            return out
        del router.open[index]
        if spec.output is None:
            return scatter_tokens(state.before, state.kept, out)
        out = list(out)
        out[spec.output] = scatter_tokens(state.before, state.kept, out[spec.output])
        return tuple(out)
    return routed


def install(cfg, model: torch.nn.Module, family, *, say: Callable = print) -> Router | None:
    """The run's `--tread` routes on the transformer `model` (or on each expert of two), its blocks' forwards wrapped
    outermost (outside the block swap's and the gradient checkpointing's, so a recomputation never draws or routes
    again); None without --tread. A transformer checkpointed by diffusers (its loop calls each block inside the
    checkpoint) is checkpointed per block instead, the same recomputation."""
    routes = parse_routes(cfg.tread or "")
    if not routes:
        return None
    from train.swap import checkpointed_forward

    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0

    experts = getattr(model, "experts", None)
    modules = list(experts) if isinstance(experts, tuple) else [model]
    config = modules[0].config
    patch = family.latent_patch(config)
    router = Router([], seed=cfg.seed, rank=rank, modules=modules, tokens=lambda xt: family.tread_tokens(config, xt),
                    keep=(lambda batch: token_mask(batch["mask"], patch)) if cfg.masked_loss else None,
                    keep_host=lambda batch: host_token_mask(batch, patch))
    for module in modules:
        spec = family.tread_route(module)
        depth = len(spec.blocks)
        router.routes = resolve_routes(routes, depth)
        if getattr(module, "gradient_checkpointing", False):
            module.disable_gradient_checkpointing()
            for block in spec.blocks:
                block.forward = checkpointed_forward(block.forward)
        for index, (ratio, start, end) in enumerate(router.routes):
            for i in range(start, end + 1):
                block = spec.blocks[i]
                block.forward = _block_forward(router, spec, index, ratio, i == start, i == end, block, block.forward)
    share = ", ".join(f"{ratio:g} of the image tokens skip blocks {start}-{end}" for ratio, start, end in router.routes)
    say(f"TREAD token routing in training forwards: {share} (of {depth} blocks; the held-out loss and validation see "
        f"every token)")
    return router
