"""Random sequences of operations on a cache, checked against a model of what every generation holds.

A case is a seed: `random.Random(seed)` draws writer sessions (new samples, removals, dataset removals and renames,
repairs, restamps, prompts), gc, runs registering and checkpointing, kills at a random file-system event and damage
to a random file. After every step the newest generation and every generation a registered run needs read exactly
what the model says (every key with its exact tensors, dataset, source and stamp, the prompts, nothing else, no
duplicates) and `verify` finds nothing; while a file is damaged each reader reads exactly that or refuses with the
library's error, and once the damage is undone everything reads again. Nothing outside the cache is touched.

    python -m tests.format.format_fuzz --cases 3000 --seed 0   # prints each failing seed with its operation trace
    python -m tests.format.format_fuzz --seed 17 --cases 1 -v  # replays one case, printing its steps
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import shards.generations
from shards import ShardWriter, gc, prompt_key, register_reader, verify
from shards.schema import sample_digest
from tests.format.fuzz_damage import DAMAGE, damage
from tests.format.fuzz_model import FINGERPRINT, PROMPT_SCHEMA, SCHEMA, Broken, State, blind, difference, fields_of, prompt_digest, prompt_of, read
from tests.format.fuzz_process import Killed, Process

BUCKETS = [(16, 16), (16, 32), (32, 16)]
DATASETS = ["", "photos", "art"]
SHARD_SAMPLES = 3  # small shards: many shards and commits per case
COMPACT_EVERY = 3  # a snapshot every few commits (the format's COMPACT_MIN, 256 in use)

# Besides damage to one file: gc killed mid-way, gc run while a snapshot is lost, and a directory inside the cache
# that links to one outside it.
KINDS = [*DAMAGE, "gc-kill", "gc-lost-snapshot", "symlink"]
# Kinds left out of the default run until the library handles them, with what goes wrong; `--kinds all` runs them.
PENDING: dict[str, str] = {}
DEFAULT_KINDS = [k for k in KINDS if k not in PENDING]


class Case:
    """One seeded sequence of steps on a fresh cache in `workdir`, with the model it is checked against."""

    def __init__(self, seed: int, workdir: Path, kinds: list[str], steps: int, log=None):
        self.rng = random.Random(seed)
        self.seed, self.kinds, self.steps, self.log = seed, kinds, steps, log
        self.root, self.outside, self.runs = workdir / "cache", workdir / "outside", workdir / "runs"
        self.gens: dict[int, State] = {}  # generation -> what it holds, for the generations the model knows
        self.newest = -1
        self.made: dict[str, tuple[int, tuple[int, int]]] = {}  # key -> (sample number, bucket)
        self.regs: dict[str, list] = {}  # run name -> [registered generation, checkpointed generations]
        self.leftovers = False  # a kill left files the next writer (or gc) deletes
        self.links: list[Path] = []
        self.trace: list[str] = []
        # files that are not the cache's: a sibling directory, and a user's notes inside the cache
        self.outside.mkdir(parents=True)
        for name in ("r00000-000000.safetensors", "prompts-0123456789abcdef.safetensors", "000000000000.json"):
            (self.outside / name).write_bytes(name.encode() * 3)  # names the library's own files have
        self.root.mkdir()
        (self.root / "NOTES.txt").write_text("mine\n")
        self.foreign = self._files(self.outside) | {"NOTES.txt": b"mine\n"}

    def note(self, line: str) -> None:
        self.trace.append(line)
        if self.log:
            self.log(f"  {len(self.trace):3d} {line}")

    @staticmethod
    def _files(directory: Path) -> dict[str, bytes]:
        return {p.relative_to(directory).as_posix(): p.read_bytes() for p in directory.rglob("*") if p.is_file()}

    # -- the model ------------------------------------------------------------------------------------------
    @property
    def state(self) -> State:
        return self.gens.get(self.newest, State())

    def needed(self) -> set[int]:
        """The generations gc keeps for registered runs (FORMAT.md, gc)."""
        out = set()
        for registered, checkpoints in self.regs.values():
            out |= set(checkpoints)
            if not checkpoints or registered > max(checkpoints):
                out.add(registered)
        return out

    def commit(self, generation: int, state: State) -> None:
        self.newest = generation
        self.gens[generation] = state

    # -- the checks ------------------------------------------------------------------------------------------
    def check(self, why: str, full: bool = True) -> None:
        """Every generation the model needs reads exactly, `verify` finds nothing (after a kill: nothing but the
        files the next writer deletes), and nothing outside the cache changed. Without `full`, the samples' bytes
        are not read and `verify` does not run (a step that wrote new files only: they are read at the next full
        check)."""
        if self.newest >= 0:
            got = read(self.root, full=full)
            want = self.state if full else blind(self.state)
            if got != (self.newest, want):
                raise Broken(f"{why}: the newest generation reads as {got[0]}, the model says {self.newest}: "
                             f"{difference(got[1], want)}")
            for g in sorted(self.needed()):
                want = self.gens[g] if full else blind(self.gens[g])
                if (got := read(self.root, g, full)) != (g, want):
                    raise Broken(f"{why}: generation {g} of a registered run: {difference(got[1], want)}")
            if full:
                report = verify(self.root)
                # what verify says of a link is not checked here: that nothing behind it changes is
                left = [p for p in report.problems if not (self.leftovers and p[1].startswith("orphan"))
                        and not any(p[0].startswith(str(link)) for link in self.links)]
                if left or report.generation != self.newest:
                    raise Broken(f"{why}: verify reports {left[:3]} at generation {report.generation}")
        self.check_foreign(why)

    def check_foreign(self, why: str) -> None:
        now = self._files(self.outside) | {"NOTES.txt": (self.root / "NOTES.txt").read_bytes()}
        if now != self.foreign:
            raise Broken(f"{why}: files that are not the cache's changed: "
                         f"{sorted(k for k in self.foreign.keys() | now.keys() if self.foreign.get(k) != now.get(k))}")

    # -- steps ------------------------------------------------------------------------------------------------
    def run(self) -> None:
        self.write(kill=False)
        for _ in range(self.steps):
            step = self.rng.choices(["write", "remove", "remove_dataset", "rename", "repair", "restamp", "prompts",
                                     "register", "checkpoint", "unregister", "gc", "damage", "symlink"],
                                    [6, 3, 1, 1, 1, 1, 1, 2, 1, 1, 2, 4, 1])[0]
            if step == "symlink" and "symlink" not in self.kinds:
                step = "gc"
            if step == "damage":
                damage(self)
            elif step in ("register", "checkpoint", "unregister"):
                getattr(self, step)()
            elif step == "gc":
                self.collect()
            elif step == "symlink":
                self.symlink()
            else:
                getattr(self, step)(kill=self.rng.random() < 0.35)
            # the samples' bytes are read after the steps that delete or damage files, and at the end
            self.check(f"after step {len(self.trace)}", full=self.leftovers or step in ("gc", "damage", "symlink"))
        self.check("at the end")

    def session(self, what: str, act, expect: State, kill: bool, partial=None) -> None:
        """One writer session doing `act(writer)`, `expect` the state it commits. Killed at a random event if `kill`:
        then the newest generation must be the state before, `expect`, or one `partial(state)` accepts."""
        before = self.state
        killer = Process(self.rng.randint(1, 60), self.rng.random() < 0.5) if kill else None
        self.note(what + (f" killed at event {killer.at}{' (torn)' if killer.tear else ''}" if killer else ""))
        try:
            with killer or Process():
                w = ShardWriter(self.root, FINGERPRINT, SCHEMA, max_shard_samples=SHARD_SAMPLES)
                try:
                    result = act(w)
                    w.finish()
                finally:
                    w.close()  # releases the locks only, as the death of the process does
        except Killed:
            self.note(f"  died at {killer.what}")
            self.leftovers = True
            generation, got = read(self.root)
            if got not in (before, expect) and not (partial and partial(got)):
                raise Broken(f"{what}, killed: the newest generation {generation} holds neither what was committed "
                             f"before nor after: {difference(got, expect)}") from None
            self.commit(generation, got)
            return
        if killer:
            self.note(f"  finished before event {killer.at}")
        self.leftovers = False
        self.commit(w.manifest.generation, expect)
        if result is not None:
            self.note(f"  {result}")

    def write(self, kill: bool) -> None:
        samples = []
        for _ in range(self.rng.randint(1, 7)):
            n = len(self.made)
            key, bucket = f"k{n:05d}", self.rng.choice(BUCKETS)
            self.made[key] = (n, bucket)
            flush = self.rng.random() < 0.3
            samples.append((key, bucket, self.rng.choice(DATASETS), self.rng.randrange(1 << 62), flush))
        new = {key: (sample_digest(key, fields_of(self.made[key][0], bucket)), ds, f"src/{key}.png", stamp)
               for key, bucket, ds, stamp, _ in samples}

        def act(w):
            for key, bucket, ds, stamp, flush in samples:
                w.write(key, bucket, fields_of(*self.made[key]), source=f"src/{key}.png", stamp=stamp, dataset=ds)
                if flush:
                    w.flush()

        before = self.state

        def partial(got: State) -> bool:  # a kill keeps the shards committed so far, each sample exact
            return before.samples.items() <= got.samples.items() and got.prompts == before.prompts and all(
                new.get(k) == v for k, v in got.samples.items() if k not in before.samples)

        self.session(f"write {[(k, b, d) for k, b, d, _, _ in samples]}", act,
                     State({**before.samples, **new}, before.prompts), kill, partial)

    def remove(self, kill: bool) -> None:
        live = sorted(self.state.samples)
        keys = set(self.rng.sample(live, min(len(live), self.rng.randint(1, 3)))) | {"absent"}
        expect = State({k: v for k, v in self.state.samples.items() if k not in keys}, self.state.prompts)
        self.session(f"remove {sorted(keys)}", lambda w: f"removed {w.remove(keys)}", expect, kill)

    def remove_dataset(self, kill: bool) -> None:
        name = self.rng.choice(DATASETS)
        expect = State({k: v for k, v in self.state.samples.items() if v[1] != name}, self.state.prompts)
        self.session(f"remove_dataset {name!r}", lambda w: f"removed {w.remove_dataset(name)}", expect, kill)

    def rename(self, kill: bool) -> None:
        old, new = self.rng.choice(DATASETS), self.rng.choice(DATASETS)
        renamed = {k: (v[0], new if v[1] == old else v[1], *v[2:]) for k, v in self.state.samples.items()}
        expect = State(renamed, self.state.prompts)
        self.session(f"rename_dataset {old!r} -> {new!r}", lambda w: w.rename_dataset(old, new), expect, kill)

    def repair(self, kill: bool) -> None:
        table = shards.generations.load(self.root).shards
        if not len(table):
            return
        path = self.rng.choice(table.paths())

        def act(w):
            keys = w.manifest.shards.samples_of(w.manifest.shards.row_of(path))[0]
            return f"copy {w.replace(path, [(k, fields_of(*self.made[k])) for k in keys])}"
        self.session(f"repair {path}", act, self.state, kill)

    def restamp(self, kill: bool) -> None:
        live = sorted(self.state.samples)
        stamps = {k: self.rng.randrange(1 << 62) for k in self.rng.sample(live, min(len(live), 2))}
        expect = State({k: (*v[:3], stamps.get(k, v[3])) for k, v in self.state.samples.items()}, self.state.prompts)
        self.session(f"restamp {sorted(stamps)}", lambda w: w.restamp(stamps), expect, kill)

    def prompts(self, kill: bool) -> None:
        drawn = [prompt_of(self.rng.randint(0, 5)) for _ in range(self.rng.randint(1, 2))]
        new = {prompt_key(p.text): p for p in drawn}
        expect = State(self.state.samples, {**self.state.prompts, **{k: prompt_digest(k, p) for k, p in new.items()}})
        what = f"add_prompts {[p.text for p in new.values()]}"
        self.session(what, lambda w: w.add_prompts(new, PROMPT_SCHEMA), expect, kill)

    def register(self) -> None:
        name = f"run{self.rng.randint(0, 3)}"
        if name in self.regs:  # a run moves on to the newest generation, keeping its checkpoints
            self.regs[name][0] = self.newest
        else:
            self.regs[name] = [self.newest, []]
        (self.runs / name).mkdir(parents=True, exist_ok=True)
        self.note(f"register {name} at generation {self.newest}")
        if not register_reader(self.root, self.runs / name, self.newest):
            raise Broken("register_reader failed on a writable cache")

    def checkpoint(self) -> None:
        if not self.regs:
            return
        name = self.rng.choice(sorted(self.regs))
        registered, checkpoints = self.regs[name]
        step = self.runs / name / "checkpoints" / f"step-{len(checkpoints):08d}"
        step.mkdir(parents=True)
        (step / "state.json").write_text(f'{{"cache_generation": {registered}, "cache_root": "{self.root.resolve()}"}}')
        (step / "COMPLETE").write_text("ok\n")
        checkpoints.append(registered)
        self.note(f"checkpoint {name} at generation {registered}")

    def unregister(self) -> None:
        if self.regs:
            name = self.rng.choice(sorted(self.regs))
            del self.regs[name]
            shutil.rmtree(self.runs / name)
            self.note(f"unregister {name} (its directory is gone)")

    def collect(self) -> None:
        killer = Process(self.rng.randint(1, 40)) if self.rng.random() < 0.3 and "gc-kill" in self.kinds else None
        self.note("gc" + (f" killed at event {killer.at}" if killer else ""))
        try:
            with killer or Process():
                report = gc(self.root)
        except Killed:
            self.note(f"  died at {killer.what}")
            self.leftovers = True
            return
        if killer:
            self.note(f"  finished before event {killer.at}")
        self.leftovers = False
        if report.generations != sorted(self.needed()):
            raise Broken(f"gc kept generations {report.generations}, the registered runs need {sorted(self.needed())}")
        self.gens = {g: s for g, s in self.gens.items() if g in self.needed() or g >= self.newest}

    def symlink(self) -> None:
        """A directory inside the cache that links to one outside it (data moved to another disk, say)."""
        link = self.root / self.rng.choice(["elsewhere", "old"])
        if link.exists() or link.is_symlink():
            return
        link.symlink_to(self.outside, target_is_directory=True)
        self.links.append(link)
        self.note(f"symlink {link.name} -> the directory outside")


def run_case(seed: int, steps: int = 12, kinds: list[str] | None = None, log=None) -> list[str]:
    """Run case `seed` in a temp directory; returns its trace. Raises `CaseFailed` with the trace on any failure."""
    kinds = DEFAULT_KINDS if kinds is None else kinds
    shards.generations.COMPACT_MIN, compact_min = COMPACT_EVERY, shards.generations.COMPACT_MIN
    # in memory when the machine has a tmpfs: a case fsyncs hundreds of times
    scratch = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory(prefix=f"fuzz-{seed}-", dir=scratch) as tmp:
        case = Case(seed, Path(tmp), kinds, steps, log)
        try:
            case.run()
        except BaseException as e:
            cause = e.__cause__ if isinstance(e, Broken) else e  # a Broken of its own needs no traceback
            lines = traceback.format_exception(cause) if cause else []
            detail = (f"{e}\n" if isinstance(e, Broken) else "") + "".join(lines)
            named = "all" if kinds == KINDS else ",".join(kinds)
            options = "" if steps == 12 else f" --steps {steps}"
            options += "" if kinds == DEFAULT_KINDS else f" --kinds {named}"
            raise CaseFailed(seed, case.trace, detail, options) from e
        finally:
            shards.generations.COMPACT_MIN = compact_min
    return case.trace


class CaseFailed(AssertionError):
    def __init__(self, seed: int, trace: list[str], detail: str, options: str = ""):
        self.seed, self.trace, self.detail = seed, trace, detail
        steps = "\n".join(f"  {i + 1:3d} {line}" for i, line in enumerate(trace))
        replay = f"{sys.executable} -m tests.format.format_fuzz --seed {seed} --cases 1 -v{options}"
        super().__init__(f"seed {seed} failed:\n{steps}\n{detail}replay: {replay}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=int(os.environ.get("FUZZ_CASES", 1000)))
    parser.add_argument("--seed", type=int, default=int(os.environ.get("FUZZ_SEED", 0)), help="the first case's seed")
    parser.add_argument("--steps", type=int, default=12, help="steps per case")
    parser.add_argument("--kinds", default=os.environ.get("FUZZ_KINDS") or None,
                        help=f"comma-separated kinds (default: all but {sorted(PENDING)}); 'all': every one of {KINDS}")
    parser.add_argument("-v", "--verbose", action="store_true", help="print each step")
    parser.add_argument("--keep-going", action="store_true", help="run every case, report every failing seed")
    args = parser.parse_args(argv)
    kinds = None if args.kinds is None else KINDS if args.kinds == "all" else args.kinds.split(",")
    if unknown := set(kinds or []) - set(KINDS):
        parser.error(f"unknown kinds {sorted(unknown)}; known: {KINDS}")
    failed, start = [], time.monotonic()
    for seed in range(args.seed, args.seed + args.cases):
        try:
            run_case(seed, args.steps, kinds, log=print if args.verbose else None)
        except CaseFailed as e:
            print(e, flush=True)
            failed.append(seed)
            if not args.keep_going:
                break
    took = time.monotonic() - start
    print(f"{args.cases if args.keep_going or not failed else failed[-1] - args.seed + 1} cases in {took:.1f} s; "
          f"failing seeds: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
