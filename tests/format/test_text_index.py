"""Texts stored once at scale: a writer and stage one's text decision hold no Python object per committed text (the
text table searched in place, the texts of the run in bounded sets), and the end-of-run scan for unreferenced texts
runs only when a writer committed texts no sample of its own referred to."""

import gc
import types

import numpy as np
import pytest
import torch

import shards.table
import shards.writer
from precompute import encoding
from precompute.encoding import EncodingPass
from shards import Cache, ShardWriter, load, verify
from shards.generations import compact
from shards.texts import TEXT_KEYS, TEXTS_CHECKED, ahead_marker, key_rows, text_key
from tests.format.test_text_dedup import FINGERPRINT, STORED_ONCE, TEXT_SCHEMA, embedding, latent, source


def caption(i: int) -> str:
    return f"caption number {i} of a cache of distinct captions"


def sorter(writer: ShardWriter) -> EncodingPass:
    """Stage one's text decision alone (`EncodingPass.texts_to_encode`), over `writer`."""
    s = EncodingPass.__new__(EncodingPass)
    s.writer, s.queued_texts, s.rebuild_texts, s.queued_kept = writer, set(), set(), 0
    return s


def write(w: ShardWriter, ids, captions=caption, decide: EncodingPass | None = None) -> None:
    """Samples `ids`, each with its caption's text (written when `decide` says to encode it, or when not cached)."""
    ids = list(ids)
    caps = [captions(i) for i in ids]
    keys = [text_key(c) for c in caps]
    fresh = decide.texts_to_encode(keys) if decide is not None else [k for k, key in enumerate(keys) if not w.has_text(key)]
    for k in fresh:
        w.write_text(caps[k], {"text": embedding(caps[k])})
    for i, key in zip(ids, keys):
        w.write(f"k{i:06d}", (64, 64), {"latent": latent(i % 7), "source": source(i), TEXT_KEYS: key_rows([key])}, source=f"img{i}")


def strings_held(*roots) -> int:
    """How many distinct str objects are reachable from `roots` through containers and instances (not through
    modules, classes, functions, tensors or arrays: those are no per-text objects)."""
    skip = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, types.MethodType, torch.Tensor, np.ndarray)
    seen, stack, count = set(), list(roots), 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, skip):
            continue
        seen.add(id(obj))
        if isinstance(obj, str):
            count += 1
        elif isinstance(obj, dict):  # keys too: the collector does not visit a dict's str keys
            stack += [*obj.keys(), *obj.values()]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack += list(obj)
        else:
            stack += gc.get_referents(obj)
    return count


def test_has_texts_is_has_text_in_bulk_over_a_snapshot_the_log_the_buffer_and_a_removal(tmp_path):
    with ShardWriter(tmp_path, FINGERPRINT, STORED_ONCE, text_schema=TEXT_SCHEMA, max_shard_samples=4) as w:
        write(w, range(10))
    compact(tmp_path, load(tmp_path), 0)  # the first ten texts in a snapshot's columns
    with ShardWriter(tmp_path, FINGERPRINT, STORED_ONCE, text_schema=TEXT_SCHEMA, max_shard_samples=4) as w:
        write(w, range(10, 20))
        w.remove({"k000003", "k000012"})  # their texts dropped
        write(w, range(20, 22))  # buffered (two samples of a shard of four)
        keys = [text_key(caption(i)) for i in range(25)] + [text_key("never written")]
        truth = [i not in (3, 12) and i < 22 for i in range(25)] + [False]
        assert w.has_texts(keys).tolist() == [w.has_text(k) for k in keys] == truth
        assert w.has_texts([]).tolist() == []


def test_the_key_lookup_of_rows_appended_since_it_was_built_is_searched_in_place(tmp_path, monkeypatch):
    monkeypatch.setattr(shards.table, "RECENT_KEYS", 5)
    with ShardWriter(tmp_path, FINGERPRINT, STORED_ONCE, text_schema=TEXT_SCHEMA, max_shard_samples=3) as w:
        write(w, range(120))
        table = w.manifest.texts
        table.sample_index()  # the whole table's lookup, as a writer's first lookup builds it
        mids, bases = [], []  # held: each lookup built is a distinct object
        for a in range(120, 300, 3):
            write(w, range(a, a + 3))
            w.flush()
            assert len(table._key_recent) <= 5 + 3  # the dict stays bounded: the rows past it get sorted hashes
            mids += [table._key_mid] if table._key_mid is not None and all(m is not table._key_mid for m in mids) else []
            bases += [table._key_base] if all(b is not table._key_base for b in bases) else []
        assert len(mids) > 3 and len(bases) > 2  # the rows since were indexed again as they grew, then the whole table
        keys = [text_key(caption(i)) for i in range(302)]
        found = [table.find_key(k) for k in keys]
        assert all(f is not None for f in found[:300]) and found[300:] == [None, None]
        assert [table.samples_of(j)[0][r] for j, r in found[:300]] == keys[:300]
        assert table.has_keys(keys).tolist() == [True] * 300 + [False, False]
        samples = w.manifest.shards  # the sample table's lookup is the same machinery
        assert [samples.find_key(f"k{i:06d}") is not None for i in (0, 130, 299, 300)] == [True, True, True, False]


def test_a_writer_and_the_text_decision_hold_no_python_object_per_committed_text(tmp_path, monkeypatch):
    monkeypatch.setattr(shards.table, "RECENT_KEYS", 64)
    monkeypatch.setattr(shards.writer, "TEXT_SIZES_KEPT", 64)
    monkeypatch.setattr(encoding, "QUEUED_TEXTS", 64)

    def held(n: int) -> int:
        root = tmp_path / str(n)
        with ShardWriter(root, FINGERPRINT, STORED_ONCE, text_schema=TEXT_SCHEMA, max_shard_samples=50) as w:
            decide = sorter(w)
            for a in range(0, n, 25):
                write(w, range(a, a + 25), decide=decide)
            w.manifest.texts.sample_index()
            w.manifest.shards.sample_index()
            write(w, range(n, n + 400), decide=decide)  # appended after the lookups were built: recent, then mid rows
            count = strings_held(w, decide)
        assert len(Cache(root).manifest.texts.keys_at(Cache(root).manifest.texts.rows)) == n + 400
        return count

    small, large = held(600), held(1800)
    assert large - small < 200, (small, large)  # 1,200 more texts (and samples) cost no string each


def test_text_bytes_are_counted_for_texts_no_longer_held_in_memory(tmp_path, monkeypatch):
    def stats(root, kept: int) -> dict:
        monkeypatch.setattr(shards.writer, "TEXT_SIZES_KEPT", kept)
        with ShardWriter(root, FINGERPRINT, STORED_ONCE, text_schema=TEXT_SCHEMA, max_shard_samples=4) as w:
            for i in range(12):  # each text committed alone before the samples of another bucket refer to it
                w.write_text(caption(i), {"text": embedding(caption(i))})
            for i in range(12):
                w.write(f"k{i:06d}", (64, 64) if i % 2 else (32, 32), {"latent": latent(i) if i % 2 else latent(i)[:, :4, :4],
                        "source": source(i), TEXT_KEYS: key_rows([text_key(caption(i)), text_key(caption(0))])})
        return load(root).text_stats()

    trimmed = stats(tmp_path / "trimmed", 1)
    assert trimmed == stats(tmp_path / "kept", 1 << 17)
    assert trimmed["inline_bytes"] == sum(embedding(caption(i)).nbytes + embedding(caption(0)).nbytes for i in range(12))


def test_texts_taken_for_encoding_are_never_taken_again_once_forgotten(tmp_path, monkeypatch):
    monkeypatch.setattr(encoding, "QUEUED_TEXTS", 8)
    with ShardWriter(tmp_path, FINGERPRINT, STORED_ONCE, text_schema=TEXT_SCHEMA, max_shard_samples=4) as w:
        decide = sorter(w)
        in_flight = [text_key(caption(i)) for i in range(1000, 1004)]  # taken, not yet handed to the writer
        assert decide.texts_to_encode(in_flight) == [0, 1, 2, 3]
        for a in range(0, 60, 6):
            write(w, range(a, a + 6), decide=decide)
        assert len(decide.queued_texts) <= 16  # bounded: the texts the writer holds were forgotten
        assert set(in_flight) <= decide.queued_texts
        asked = [text_key(caption(i)) for i in range(60)] + in_flight
        assert decide.texts_to_encode(asked + asked) == []  # cached, buffered or in flight: none is encoded again
        decide.rebuild_texts = {asked[0]}
        assert decide.texts_to_encode([text_key(caption(100)), asked[1]]) == [0]


def spy_scans(monkeypatch) -> list:
    scans = []
    real = ShardWriter._drop_texts

    def counted(self, retired, added):
        if not retired and not added:
            scans.append(self.manifest.generation)
        return real(self, retired, added)

    monkeypatch.setattr(ShardWriter, "_drop_texts", counted)
    return scans


def drop(root, rank: int = 0) -> int:
    with ShardWriter(root, FINGERPRINT, STORED_ONCE, rank=rank) as w:
        return w.drop_unreferenced_texts()


def test_the_scan_for_unreferenced_texts_runs_only_when_a_writer_left_texts_ahead_of_its_samples(tmp_path, monkeypatch):
    scans = spy_scans(monkeypatch)
    with ShardWriter(tmp_path, FINGERPRINT, STORED_ONCE, text_schema=TEXT_SCHEMA, max_shard_samples=4) as w:
        write(w, range(10))  # texts committed alone ahead of their samples (four at a time), all referred to at the end
        assert w.manifest.extra.get(ahead_marker(0))
    assert not load(tmp_path).extra.get(ahead_marker(0))  # taken back at finish
    assert drop(tmp_path) == 0 and len(scans) == 1  # never checked before (a cache of writers before the marks): once
    assert load(tmp_path).extra.get(TEXTS_CHECKED)
    with ShardWriter(tmp_path, FINGERPRINT, STORED_ONCE, max_shard_samples=4) as w:
        write(w, range(10, 20))
    assert drop(tmp_path) == 0 and len(scans) == 1  # a run that only added referred-to texts: no scan

    with ShardWriter(tmp_path, FINGERPRINT, STORED_ONCE, rank=2) as w:  # a sample refused after its text was written
        w.write_text("refused", {"text": embedding("refused")})
        with pytest.raises(ValueError, match="NaN|Inf|finite"):
            w.write("k999999", (64, 64), {"latent": latent(0) * float("nan"), "source": source(0),
                                          TEXT_KEYS: key_rows([text_key("refused")])})
    assert load(tmp_path).extra.get(ahead_marker(2))
    assert drop(tmp_path) == 1 and len(scans) == 2
    assert not load(tmp_path).extra.get(ahead_marker(2)) and drop(tmp_path) == 0 and len(scans) == 2

    w = ShardWriter(tmp_path, FINGERPRINT, STORED_ONCE, rank=1, max_shard_samples=4)  # killed between texts and samples
    write(w, range(20, 26))  # six texts committed (four alone), the samples of the last two still buffered
    w.close()
    assert load(tmp_path).extra.get(ahead_marker(1))
    with ShardWriter(tmp_path, FINGERPRINT, STORED_ONCE, rank=1, max_shard_samples=4) as w:  # the rank's next run
        write(w, range(30, 40))
    assert load(tmp_path).extra.get(ahead_marker(1))  # the killed run's mark is not its to take back
    assert drop(tmp_path) == 2 and len(scans) == 3
    assert drop(tmp_path) == 0 and len(scans) == 3
    cache = Cache(tmp_path)
    assert cache.manifest.text_stats()["texts"] == len(cache) == 34 and verify(tmp_path).ok


def reference_tensors(table, texts: bool) -> dict[str, torch.Tensor]:
    """The sample index (and text references) of a snapshot as they were written when every string was decoded."""
    from shards.table import _ragged

    rows = table.rows
    keys, sources, stamps, shard, refs, ref_shard = [], [], [], [], [], []
    for i, j in enumerate(rows):
        k, s, st = table.samples_of(int(j))
        keys, sources, stamps, shard = keys + k, sources + s, stamps + st, shard + [i] * len(k)
        mine = table.texts_of(int(j))
        refs, ref_shard = refs + mine, ref_shard + [i] * len(mine)
    P, S = table.names
    out = {}
    out[f"{S}.key"], out[f"{S}.key.offsets"] = _ragged(keys)
    out[f"{S}.source"], out[f"{S}.source.offsets"] = _ragged(sources)
    out[f"{S}.stamp"], out[f"{S}.shard"] = torch.tensor(stamps, dtype=torch.int64), torch.tensor(shard, dtype=torch.int64)
    if texts:
        out[f"{S}.text"], out[f"{S}.text.offsets"] = _ragged(refs)
        out[f"{S}.text_shard"] = torch.tensor(ref_shard, dtype=torch.int64)
    return out


def test_a_snapshot_copies_the_sample_index_and_text_references_byte_for_byte_without_decoding_them(tmp_path):
    with ShardWriter(tmp_path, FINGERPRINT, STORED_ONCE, text_schema=TEXT_SCHEMA, max_shard_samples=4) as w:
        write(w, range(10), captions=lambda i: f"caption {i % 6} é")  # shared and non-ASCII captions
    compact(tmp_path, load(tmp_path), 0)
    with ShardWriter(tmp_path, FINGERPRINT, STORED_ONCE, max_shard_samples=4) as w:
        write(w, range(10, 17))
        w.remove({"k000002", "k000011"})
        w.restamp({"k000005": 7})
    m = load(tmp_path)
    assert m.shards._snapshot_samples is not None and m.shards._texts_of  # rows from both
    for table, texts in ((m.shards, True), (m.texts, False)):
        got, want = table.to_tensors(texts), reference_tensors(table, texts)
        for name, t in want.items():
            assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    compact(tmp_path, m, 0)
    again = load(tmp_path)
    assert [again.shards.samples_of(int(j)) for j in again.shards.rows] == [m.shards.samples_of(int(j)) for j in m.shards.rows]
    assert verify(tmp_path).ok and len(Cache(tmp_path)) == 15
    empty = ShardWriter(tmp_path / "empty", FINGERPRINT, STORED_ONCE, text_schema=TEXT_SCHEMA)
    empty.finish()
    t = load(tmp_path / "empty").shards
    got, want = t.to_tensors(True), reference_tensors(t, True)
    assert all(torch.equal(got[name], want[name]) and got[name].dtype == want[name].dtype for name in want)


def test_a_writer_marks_texts_ahead_again_after_a_scan_took_its_mark_back(tmp_path, monkeypatch):
    scans = spy_scans(monkeypatch)
    with ShardWriter(tmp_path, FINGERPRINT, STORED_ONCE, text_schema=TEXT_SCHEMA, max_shard_samples=2) as w:
        write(w, range(4))
    assert drop(tmp_path) == 0 and len(scans) == 1  # checked once
    late = ShardWriter(tmp_path, FINGERPRINT, STORED_ONCE, rank=1, max_shard_samples=2)
    for i in range(2):  # committed alone: ahead of samples that never come
        late.write_text(caption(100 + i), {"text": embedding(caption(100 + i))})
    assert load(tmp_path).extra.get(ahead_marker(1))
    assert drop(tmp_path) == 2 and len(scans) == 2 and not load(tmp_path).extra.get(ahead_marker(1))
    for i in range(2, 4):  # ahead again, then killed
        late.write_text(caption(100 + i), {"text": embedding(caption(100 + i))})
    late.close()
    assert load(tmp_path).extra.get(ahead_marker(1))
    assert drop(tmp_path) == 2 and len(scans) == 3
    assert load(tmp_path).text_stats()["texts"] == 4 and verify(tmp_path).ok
