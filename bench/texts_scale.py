"""What texts stored once cost per text at scale: a cache of N samples, each with a caption of its own (the LAION
case: N distinct texts), written and then decided on by stage one's own functions.

The cache is built with `shards.ShardWriter` the way stage one writes it: per batch of 64 captions the text keys,
`EncodingPass.texts_to_encode` (which texts to encode: not cached, not taken before in this run), `write_text` for
each new one and `write` for each sample (a tiny latent and its `text_keys`), one bucket, S samples (and texts) per
shard; then compacted into a snapshot, as any cache past a few hundred commits is. Each source tree (`--code`: this
checkout by default; e.g. also a worktree of main, for the figures before a change) writes its own cache and is
measured on it, each measurement in a fresh process with one torch thread. Memory, per cached text: the peak RSS
growth (VmHWM: it counts the pages of the cache's snapshot the process maps and reads, 64 bytes per text key read)
and the peak anonymous memory's growth ("anon": RssAnon sampled every 10 ms; the heap and arrays, which the page
cache cannot take back).

- build: writing N distinct texts (and their N samples) to an empty cache, then the end-of-run drop of unreferenced
  texts ("drop": its first scan, the cache was never checked). compact: the snapshot of it, apart.
- decide: a re-run in which every caption is asked (every input changed): the manifest loaded, the rank's writer
  opened on a copy of it (as `precompute.run` does), `texts_to_encode` over all N text keys in batches of 64 (none
  is encoded again: checked), the writer finished; then rank 0's final writer's `drop_unreferenced_texts` ("drop").
  Microseconds per caption.
- append: the same start, then A more samples with A new distinct captions written (the whole write path), finished
  and the end-of-run drop; microseconds per appended text. Written to a copy of the cache, deleted after.
- reader: the training side's text index (`Cache.text_index`), its memory; microseconds per `locate_text`.
- each more cached text: with two sizes, the growth of the anonymous peak between them per text added: what a
  committed text costs beyond the run's own bounded sets.

GOAL: no Python object per committed text: each more cached text well under 100 bytes (decide and append), and the
decide row's anonymous peak under 100 bytes per cached text.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import typer

HERE = Path(__file__).resolve().parents[1]
BATCH = 64
GOAL_BYTES = 100


def caption(i: int) -> str:
    return f"a photograph of subject number {i} standing in front of a plain wall, natural light"


# -- in the measuring process (imports of shards/precompute come from the tree under test) ---------------------------
def _memory(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


class _AnonPeak:
    """The most anonymous memory (RssAnon: the heap, arrays; not the cache's files mapped) seen while it runs, sampled
    every 10 ms on a thread of its own."""

    def __enter__(self):
        import threading

        self.peak, self._stop = _memory("RssAnon"), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, _memory("RssAnon"))

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _memory("RssAnon"))


def _reset_peak() -> int:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _memory("VmRSS")


def _schemas():
    import torch

    from shards import Field
    from shards.texts import TEXT_KEYS

    schema = {"latent": Field(torch.bfloat16), TEXT_KEYS: Field(torch.uint8, ragged=True)}
    return schema, {"text": Field(torch.bfloat16, ragged=True)}


FINGERPRINT = {"vae": {"id": "bench-vae"}, "text_encoder": {"id": "bench-t5", "max_length": 64}}


def _sorter(writer):
    """Stage one's text decision alone (`EncodingPass.texts_to_encode`): no encoder exists."""
    from precompute.encoding import EncodingPass

    sorter = EncodingPass.__new__(EncodingPass)
    sorter.writer, sorter.queued_texts, sorter.rebuild_texts, sorter.queued_kept = writer, set(), set(), 0
    return sorter


def _write(writer, sorter, start: int, count: int) -> None:
    """Samples start..start+count, each with its own caption, written as stage one writes them."""
    import torch

    from shards.texts import TEXT_KEYS, key_rows, text_key

    latent = torch.zeros(4, 4, 4, dtype=torch.bfloat16)  # (4, h/8, w/8)
    text = torch.ones(2, 16, dtype=torch.bfloat16)  # (L, D)
    for a in range(start, start + count, BATCH):
        ids = range(a, min(start + count, a + BATCH))
        captions = [caption(i) for i in ids]
        keys = [text_key(c) for c in captions]
        for k in sorter.texts_to_encode(keys):
            writer.write_text(captions[k], {"text": text})
        for i, key in zip(ids, keys):
            writer.write(f"{i * 0x9E3779B97F4A7C15 % 2**64:016x}", (32, 32), {"latent": latent, TEXT_KEYS: key_rows([key])})


def _drop(root: str, manifest) -> float:
    from shards import ShardWriter

    t0 = time.perf_counter()
    schema, _ = _schemas()
    with ShardWriter(root, FINGERPRINT, schema, manifest=manifest.copy() if manifest is not None else None) as final:
        final.drop_unreferenced_texts()
    return time.perf_counter() - t0


def measure(what: str, root: str, n: int, per_shard: int, appended: int) -> dict:
    """One measurement (`build`, `decide`, `append` or `reader`) in this process; see the module's docstring."""
    import torch

    import precompute.encoding  # noqa: F401  (imported before the peak is reset: its imports are no per-text cost)
    import shards
    from shards import ShardWriter
    from shards.generations import compact
    from shards.texts import text_key

    torch.set_num_threads(1)
    schema, text_schema = _schemas()
    anon_before, sampler = _memory("RssAnon"), _AnonPeak().__enter__()
    before, t0, c0 = _reset_peak(), time.perf_counter(), time.process_time()
    if what == "build":
        writer = ShardWriter(root, FINGERPRINT, schema, text_schema=text_schema, max_shard_samples=per_shard)
        _write(writer, _sorter(writer), 0, n)
        writer.finish()
        del writer  # its manifest: the drop's writer loads the cache again, as stage one's final writer does
        write_s = time.perf_counter() - t0
        drop_s = _drop(root, None)
        out = {"texts": n, "write_s": write_s, "drop_s": drop_s, "peak_bytes": _memory("VmHWM") - before,
               "peak_anon_bytes": sampler.peak - anon_before}
        # a snapshot, as any cache past a few hundred commits has (stage one's writers compact as they commit): apart
        before, anon_compact = _reset_peak(), _memory("RssAnon")
        sampler.peak = anon_compact
        t1 = time.perf_counter()
        compact(Path(root), shards.load(root), 0)
        out |= {"compact_s": time.perf_counter() - t1, "compact_peak_bytes": _memory("VmHWM") - before,
                "compact_peak_anon_bytes": sampler.peak - anon_compact}
    elif what == "reader":  # the training side: its text index, then texts looked up as its reads look them up
        cache, asked = shards.Cache(root), range(0, n, max(1, n // 20_000))
        t1 = time.perf_counter()
        cache.text_index()
        t2 = time.perf_counter()
        out = {"texts": n, "open_s": t1 - t0, "index_s": t2 - t1, "drop_s": 0.0, "peak_bytes": _memory("VmHWM") - before,
               "peak_anon_bytes": sampler.peak - anon_before}
        for i in asked:  # timed only: each text shard read opens its reader, which holds its keys
            assert cache.locate_text(text_key(caption(i))) is not None
        out["asked_s"] = (time.perf_counter() - t2) * n / len(asked)  # per lookup (the row divides by the texts)
    else:
        manifest = shards.load(root)
        writer = ShardWriter(root, FINGERPRINT, schema, max_shard_samples=per_shard, manifest=manifest.copy())
        open_s = time.perf_counter() - t0
        sorter = _sorter(writer)
        t1 = time.perf_counter()
        if what == "decide":
            for a in range(0, n, BATCH):
                fresh = sorter.texts_to_encode([text_key(caption(i)) for i in range(a, min(n, a + BATCH))])
                assert not fresh, f"caption {a + fresh[0]} was cached but would be encoded again"
        else:
            _write(writer, sorter, n, appended)
        asked_s = time.perf_counter() - t1
        writer.finish()
        finish_s = time.perf_counter() - t1 - asked_s
        drop_s = _drop(root, manifest)
        out = {"texts": n, "open_s": open_s, "asked_s": asked_s, "finish_s": finish_s, "drop_s": drop_s}
    sampler.__exit__()
    out = {"peak_bytes": _memory("VmHWM") - before, "peak_anon_bytes": sampler.peak - anon_before} | out
    return out | {"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0}


# -- the driver --------------------------------------------------------------------------------------------------------
def in_child(code: Path, what: str, root: Path, n: int, per_shard: int, appended: int, timeout: float = 7200) -> dict:
    """`measure(...)` in a fresh process whose `shards` and `precompute` are those of source tree `code`."""
    program = (f"import sys, json; sys.path.insert(0, {str(HERE)!r}); import bench.texts_scale as m; "
               f"sys.path.insert(0, {str(code)!r}); "
               f"import shards; assert shards.__file__.startswith({str(code)!r}), shards.__file__; "
               f"print(json.dumps(m.measure({what!r}, {str(root)!r}, {n}, {per_shard}, {appended})))")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=str(code))
    if done.returncode:
        raise RuntimeError(f"{what} with the code of {code} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def row(label: str, r: dict, per: int, timed: str, judged: bool = True) -> str:
    n = max(r["texts"], 1)
    us = r[timed] / max(per, 1) * 1e6
    b, anon = r["peak_bytes"] / n, r.get("peak_anon_bytes", 0) / n
    verdict = ("  PASS" if anon < GOAL_BYTES else "  FAIL") if judged else ""
    drop = f"drop {r['drop_s']:6.2f} s ({r['drop_s'] / n * 1e6:5.2f} us/text)"
    return (f"{label:<34} {r['peak_bytes'] / 2**20:7.1f} MB {b:6.1f} B/text (anon {anon:6.1f}) {us:7.2f} us/text  "
            f"{drop}  wall {r['wall_s']:6.1f} s{verdict}")


def main(
    sizes: str = typer.Option("50000,200000", help="Distinct captions in the cache (one per sample), comma-separated; one cache "
                                             "each (two or more: what each more text costs). 1000000 takes a few "
                                             "minutes per tree."),
    appended: int = typer.Option(20_000, help="Samples with new distinct captions the append row writes."),
    samples_per_shard: int = typer.Option(10_000, help="Samples (and texts) per shard."),
    code: list[Path] = typer.Option(None, help="Source trees to measure side by side (e.g. a worktree of main for the "
                                               "figures before a change), each on the cache it writes itself; default: "
                                               "this checkout."),
    out: Path = typer.Option(None, help="Directory for the caches (default: a temporary one, deleted at the end)."),
    keep: bool = typer.Option(False, help="Keep each cache in --out as texts-N-S-TREE and measure an existing one there "
                                          "instead of building it again (its build row is then skipped)."),
    json_out: bool = typer.Option(False, "--json", help="Also print every result as one JSON object (the last line)."),
) -> None:
    """Peak memory and time per text of stage one's text decisions, a writer appending texts, and the end-of-run drop
    of unreferenced texts, over a cache of N distinct captions, for one or more source trees side by side."""
    sys.path.insert(0, str(HERE))
    from bench.common import pin_threads

    print(pin_threads(1))
    if keep and out is None:
        raise typer.BadParameter("--keep needs --out DIR (where the caches are kept)")
    trees = [p.resolve() for p in code] if code else [HERE]
    for tree in trees:
        if not (tree / "shards" / "writer.py").is_file():
            raise typer.BadParameter(f"--code {tree} is not a source tree of this project (no shards/writer.py)")
    base = Path(out) if out is not None else Path(tempfile.mkdtemp(prefix="texts-scale-"))
    base.mkdir(parents=True, exist_ok=True)
    results = {}
    try:
        for n in (int(s) for s in sizes.split(",") if s.strip()):
            for tree in trees:
                root = base / f"texts-{n}-{samples_per_shard}-{tree.name}"  # each tree on the cache it wrote itself
                if not (keep and (root / "_log").is_dir()):
                    shutil.rmtree(root, ignore_errors=True)
                    results[f"{n}/build/{tree}"] = r = in_child(tree, "build", root, n, samples_per_shard, 0)
                    print(row(f"{n:,} build ({tree.name})", r, n, "write_s", judged=False), flush=True)
                    c = {"texts": n, "peak_bytes": r["compact_peak_bytes"], "peak_anon_bytes": r["compact_peak_anon_bytes"],
                         "compact_s": r["compact_s"], "drop_s": 0.0, "wall_s": r["compact_s"]}
                    print(row(f"{n:,} compact ({tree.name})", c, n, "compact_s", judged=False), flush=True)
                r = in_child(tree, "decide", root, n, samples_per_shard, 0)
                results[f"{n}/decide/{tree}"] = r
                print(row(f"{n:,} decide ({tree.name})", r, n, "asked_s"), flush=True)
                copy = base / f"append-{n}"
                shutil.rmtree(copy, ignore_errors=True)
                shutil.copytree(root, copy)
                try:
                    r = in_child(tree, "append", copy, n, samples_per_shard, appended)
                finally:
                    shutil.rmtree(copy, ignore_errors=True)
                results[f"{n}/append/{tree}"] = r
                print(row(f"{n:,} append {appended:,} ({tree.name})", r, appended, "asked_s", judged=False), flush=True)
                results[f"{n}/reader/{tree}"] = r = in_child(tree, "reader", root, n, samples_per_shard, 0)
                print(row(f"{n:,} reader ({tree.name})", r, n, "asked_s", judged=False), flush=True)
                if not keep:
                    shutil.rmtree(root, ignore_errors=True)
    finally:
        if out is None:
            shutil.rmtree(base, ignore_errors=True)
    sizes_done = sorted({int(k.split("/")[0]) for k in results})
    for what in ("decide", "append"):  # what each more cached text costs: the growth between two sizes
        for tree in trees:
            for a, b in zip(sizes_done, sizes_done[1:]):
                ra, rb = results.get(f"{a}/{what}/{tree}"), results.get(f"{b}/{what}/{tree}")
                if ra and rb:
                    per = (rb["peak_anon_bytes"] - ra["peak_anon_bytes"]) / (b - a)
                    print(f"{what} ({tree.name}): each more cached text {per:6.1f} B anonymous ({a:,} -> {b:,} texts)"
                          f"{'  PASS' if per < GOAL_BYTES else '  FAIL'}")
    if json_out:
        print(json.dumps(results))


if __name__ == "__main__":
    typer.run(main)
