"""`python -m shards`: look into a cache (inspect, ls), check it (verify), delete what no reader needs (gc),
convert a version 1 cache (upgrade).

Exit codes: 0 done; 1 the cache is damaged (verify found damage, or a command stopped at a damaged or missing
file, which the message names with what to do); 2 not a cache (yet), one this library cannot read (another
format version), or one this user cannot change (gc, upgrade); 3 busy (a run or a writer holds the cache).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import typer

from shards.reader import Cache
from shards.references import REFERENCE_FIELDS, REFERENCE_SHAPE
from shards.schema import CacheBusy, DamagedCache, FormatError
from shards.verify import verify as verify_cache

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)

CacheDir = typer.Argument(..., exists=True, file_okay=False, help="The cache directory (holding _log/ and index.json).")


def _fail(e: Exception) -> typer.Exit:
    typer.echo(f"error: {e}", err=True)
    return typer.Exit(3 if isinstance(e, CacheBusy) else 1 if isinstance(e, DamagedCache) else 2)


def _open(root: Path) -> Cache:
    try:
        return Cache(root)
    except (OSError, FormatError) as e:
        raise _fail(e) from None


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def reference_stats(m) -> dict | None:
    """An edit cache's reference images, from the shard table alone (None for a cache without reference fields):
    the samples that have references, how many references they have, and the bytes of their reference fields.

    Each reference is one (h, w) row of `reference_shape`, so a shard's references are its field bytes less the
    offsets, over a row's bytes. A shard holds one source's samples, and a source's samples either all pair with
    reference images (one without them is skipped) or none do: the samples with references are those of the shards
    that hold any."""
    if REFERENCE_SHAPE not in m.schema or REFERENCE_SHAPE not in m.shards.fields:
        return None
    stored = m.shards.column("field_bytes")
    samples = m.shards.column("samples")
    row = 2 * m.schema[REFERENCE_SHAPE].dtype.itemsize
    refs = (stored[:, m.shards.fields.index(REFERENCE_SHAPE)] - 8 * (samples + 1)) // row
    nbytes = sum(stored[:, m.shards.fields.index(name)] for name in REFERENCE_FIELDS if name in m.shards.fields)
    has = refs > 0
    names = np.array(m.shards.datasets(), dtype=object)
    with_refs = int(samples[has].sum())
    return {
        "samples_with_references": with_refs,
        "samples_without_references": int(samples[~has].sum()),
        "references": int(refs.sum()),
        "references_per_sample": int(refs.sum()) / max(with_refs, 1),  # of the samples that have them
        "bytes_per_sample": int(nbytes[has].sum()) / max(with_refs, 1),  # both fields, of the samples that have them
        "sources": {str(name): {"samples_with_references": int(samples[has & (names == name)].sum()),
                                "references": int(refs[names == name].sum())} for name in sorted(set(names.tolist()))},
    }


def reference_line(refs: dict) -> str:
    """`reference_stats` as one line of a report."""
    line = f"{refs['samples_with_references']:,} samples with reference images"
    if refs["samples_without_references"]:
        line += f" (and {refs['samples_without_references']:,} without, text-to-image)"
    if refs["samples_with_references"]:
        line += (f", {refs['references_per_sample']:.2f} references per sample, {_human(refs['bytes_per_sample'])} of "
                 f"reference fields per sample")
    return line


def summary(cache: Cache) -> dict:
    """Everything `inspect` shows, as plain JSON."""
    m = cache.manifest
    field_bytes = dict(zip(m.shards.fields, (int(v) for v in m.shards.column("field_bytes").sum(0))))
    n = max(m.num_samples, 1)
    captions = m.captions()
    record = m.extra.get("precompute") or {}
    # a cache built at several resolutions, or at another than its base one: each one's samples and bucket table
    resolutions = {}
    if "resolutions" in record:
        held = {tag or record.get("base_resolution"): count for tag, count in m.resolutions().items()}
        resolutions = {"resolutions": {r: {"samples": held.get(int(r), 0), "buckets": names}
                                       for r, names in record["resolutions"].items()}}
    return {
        "root": str(cache.root),
        "samples": m.num_samples,
        "shards": len(m.shards),
        "bytes": m.num_bytes,
        "bytes_per_sample": m.num_bytes / n,
        "fields": {
            name: {**spec.to_json(), "bytes_per_sample": field_bytes[name] / n} for name, spec in m.schema.items()
        },
        "buckets": {b.name: {"samples": st.samples, "shards": st.shards, "bytes": st.bytes} for b, st in m.buckets().items()},
        # the named sources of stage one's dataset file ("": samples cached without a name), with what stage one
        # recorded of each (its path, repeats or weight, caption options)
        "sources": {name: {**totals, **m.extra.get("sources", {}).get(name, {}), **_captions(captions, name, totals)}
                    for name, totals in m.datasets().items()},
        # a cache that stores each text once: the texts stored, the references to them, the bytes saved
        **({"texts": m.text_stats()} if m.texts is not None else {}),
        # an edit cache: the samples with reference images, references per sample and the bytes of their fields
        **({"references": refs} if (refs := reference_stats(m)) is not None else {}),
        **resolutions,
        "generation": m.generation,
        "fingerprint_sha256": m.fingerprint_sha256,
        "fingerprint": m.fingerprint,
    }


def _captions(captions: dict[str, int], name: str, totals: dict) -> dict:
    """A source's caption count and captions per sample (several: a list of captions, or caption variants)."""
    if name not in captions:
        return {}
    return {"captions": captions[name], "captions_per_sample": captions[name] / max(totals["samples"], 1)}


# the caption-variant options stage one records of a source, as `inspect` shows them (the dataset file's keys)
VARIANT_KEYS = ("shuffle_tags", "keep_tokens", "keep_tokens_separator", "tag_dropout", "tag_separator")


def _caption_line(src: dict) -> str | None:
    """A source's captions per sample and its caption variants, when it has either."""
    parts = []
    if src.get("caption_variants", 1) > 1:
        options = [k if v is True else f"{k} {v!r}" for k in VARIANT_KEYS if (v := src.get(k)) not in (None, False, 0)]
        parts.append(f"caption_variants {src['caption_variants']} ({', '.join(options)})")
    if "captions_per_sample" in src and (parts or src["captions_per_sample"] != 1):
        parts.insert(0, f"{src['captions_per_sample']:.2f} captions per sample ({src['captions']} in all)")
    return "; ".join(parts) or None


@app.command()
def inspect(
    root: Path = CacheDir,
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON, for machines."),
) -> None:
    """Samples, bucket histogram, bytes per sample by field and the fingerprint."""
    info = summary(_open(root))
    if as_json:
        typer.echo(json.dumps(info, indent=1))
        return
    typer.echo(f"{info['root']}: {info['samples']} samples in {info['shards']} shards, {_human(info['bytes'])} "
               f"({_human(info['bytes_per_sample'])} per sample), generation {info['generation']}")
    clips = any(name.count("x") == 2 for name in info["buckets"])  # a clip's bucket is FxHxW
    typer.echo(f"\nbuckets ({'frames x ' if clips else ''}height x width):")
    most = max((b["samples"] for b in info["buckets"].values()), default=1)
    for name, b in info["buckets"].items():
        bar = "#" * max(1, round(40 * b["samples"] / most)) if b["samples"] else ""
        typer.echo(f"  {name:>10} {b['samples']:>9} {bar}")
    if "resolutions" in info:
        typer.echo("\nresolutions: " + ", ".join(f"{r} ({v['samples']} samples, a table of {len(v['buckets'])} buckets)"
                                                for r, v in info["resolutions"].items()))
    typer.echo("\nsources:")
    for name, src in info["sources"].items():
        share = f"weight {src['weight']:g}" if src.get("weight") is not None else f"repeats {src.get('repeats', 1)}"
        if src.get("is_reg"):  # a class (regularisation) source and the loss weight of its batches
            share += f", class (is_reg), prior_loss_weight {src.get('prior_loss_weight', 1.0):g}"
        if src.get("eval"):  # a held-out source: never trained on, its loss evaluated
            share += ", eval (held out of training)"
        typer.echo(f"  {name or '(unnamed)':<24} {src['samples']:>9} samples {src['shards']:>7} shards {_human(src['bytes']):>10}"
                   f"  {share}  {src.get('path', '')}")
        if line := _caption_line(src):
            typer.echo(f"  {'':<24} {line}")
        if src.get("masks"):  # stage one cached a loss mask per sample (for --masked-loss)
            where = "the images' alpha channel" if src.get("alpha_mask") else src.get("mask") or "mask files"
            typer.echo(f"  {'':<24} loss masks from {where}")
        if (refs := info.get("references", {}).get("sources", {}).get(name)) and refs["samples_with_references"]:
            typer.echo(f"  {'':<24} reference images: {refs['references']} for {refs['samples_with_references']} samples "
                       f"({refs['references'] / refs['samples_with_references']:.2f} per sample)")
    if "texts" in info:
        t = info["texts"]
        typer.echo(f"\ntexts (each stored once): {t['texts']} in {t['shards']} text shards, {_human(t['bytes'])}; "
                   f"{t['references']} references from samples, which would take {_human(t['inline_bytes'])} stored with each; "
                   f"saved {_human(t['saved']) if t['saved'] >= 0 else '-' + _human(-t['saved'])} (after "
                   f"{_human(t['key_bytes'])} of text keys)")
    if "references" in info:
        typer.echo(f"\nreferences: {reference_line(info['references'])}")
    typer.echo("\nfields (bytes per sample):")
    for name, f in info["fields"].items():
        typer.echo(f"  {name:<24} {f['kind']:<7} {f['dtype']:<9} {_human(f['bytes_per_sample']):>10}")
    typer.echo(f"\nfingerprint {info['fingerprint_sha256'][:16]}:")
    for key, value in sorted(info["fingerprint"].items()):
        text = json.dumps(value, sort_keys=True)
        typer.echo(f"  {key}: {text if len(text) <= 100 else text[:97] + '...'}")


@app.command()
def ls(root: Path = CacheDir) -> None:
    """One line per sample, tab-separated: key, bucket, shard, content digest, input (the file or tar member it was
    read from) and source (the dataset file's name for it; empty for samples cached without one)."""
    cache = _open(root)
    for j, entry in enumerate(cache.shards):
        try:
            reader = cache.shard(j)
            keys, sources, _ = cache.shards.samples_of(int(cache.shards.rows[j]))
        except DamagedCache as e:  # names the shard and the repair, or the snapshot to restore
            raise _fail(e) from None
        for i, (key, source) in enumerate(zip(keys, sources)):
            typer.echo(f"{key}\t{entry.bucket.name}\t{entry.path}\t{reader.digest(i).hex()}\t{source}\t{entry.dataset}")


@app.command()
def verify(
    root: Path = CacheDir,
    checksums: bool = typer.Option(True, help="Compare each shard's sha256 with the manifest (reads every byte)."),
    deep: bool = typer.Option(True, help="Check offsets, shapes, dtypes, per-sample digests, duplicate keys; scan for NaN/Inf."),
) -> None:
    """Check every shard against the manifest; exit 1 naming every bad file, 2 when ROOT is not a cache (yet)."""
    try:
        report = verify_cache(root, checksums=checksums, deep=deep)
    except OSError as e:  # a file this user may not read
        raise _fail(e) from None
    if report.not_a_cache:
        typer.echo(f"error: {report.not_a_cache}", err=True)
        raise typer.Exit(2)
    for path, msg in report.warnings:
        typer.echo(f"warning: {path}: {msg}", err=True)
    for path, msg in report.problems:
        typer.echo(f"BAD {path}: {msg}")
    texts = f" ({report.texts} texts stored once)" if report.texts else ""
    typer.echo(f"checked {report.shards} shards, {report.samples} samples{texts}, {_human(report.bytes)} of generation "
               f"{report.generation}: " + ("ok" if report.ok else f"{len(report.bad_files)} bad files")
               + (f"; {report.retired} retired files kept for readers of earlier generations (python -m shards gc)" if report.retired else "")
               + (f"; {report.in_progress} files of a running writer" if report.in_progress else ""))
    if not report.ok:
        raise typer.Exit(1)


@app.command()
def gc(
    root: Path = CacheDir,
    dry_run: bool = typer.Option(False, "--dry-run", help="List what would be deleted; delete nothing."),
) -> None:
    """Delete shards and log entries that neither the newest generation nor a resumable training run needs
    (retired by removals, left by interrupted writers). Runs register the generation they read; a run whose
    directory is gone no longer counts. Deleting nothing, exits 3 while a run or a writer holds the cache, 1 when the
    log is damaged, 2 when this user cannot change the cache. Symbolic links in the cache are never followed."""
    from shards.gc import gc as collect

    try:
        report = collect(root, dry_run=dry_run)
    except (CacheBusy, OSError, FormatError) as e:  # OSError: a read-only cache, nothing deleted
        raise _fail(e) from None
    for path in report.deleted:
        typer.echo(("would delete " if dry_run else "deleted ") + path)
    for path in report.links:
        typer.echo(f"not entered: {path} is a symbolic link (nothing behind it is deleted)")
    for path in report.stale_readers:
        typer.echo(f"dropped the registration of a run that is gone: {path}")
    typer.echo(f"{'would free' if dry_run else 'freed'} {_human(report.bytes)} in {len(report.deleted)} files; generations kept "
               f"for resumable runs: {report.generations or 'none'}")


@app.command()
def upgrade(root: Path = CacheDir) -> None:
    """Convert a version 1 cache (a single index.json) to this version, in place, rewriting no shard."""
    from shards.upgrade import upgrade as convert

    try:
        m = convert(root)
    except (CacheBusy, OSError, FormatError) as e:
        raise _fail(e) from None
    typer.echo(f"{root}: upgraded, {m.num_samples} samples in {len(m.shards)} shards (the old index is index.v1.json)")
