"""Damage of the format fuzz: one file of the cache truncated, flipped or deleted, and what readers, gc and writers
do while it is damaged. Each reader reads exactly the generation the model has or refuses with the library's error;
`verify` reports every damage a reader refuses; once the damage is undone everything reads again."""

from shards import ShardWriter, gc, verify
from shards.log import snapshots
from tests.format.fuzz_model import FINGERPRINT, SCHEMA, Broken, State, difference, read, refusal
from tests.format.fuzz_process import Process

DAMAGE = ["commit-truncate", "commit-flip", "commit-delete-last", "commit-delete-middle", "snapshot-truncate",
          "snapshot-flip", "snapshot-delete", "pointer-truncate", "pointer-flip", "pointer-delete", "shard-truncate",
          "shard-flip", "shard-delete", "prompts-truncate", "prompts-flip", "prompts-delete"]


def damage(case) -> None:
    """Damage one file of `case`'s cache in one of the ways its kinds allow, check every reader, gc and a writer meanwhile,
    then undo the damage."""
    kind = case.rng.choice([k for k in case.kinds if k in DAMAGE])
    what, how = kind.split("-", 1)
    logs = sorted(p for p in (case.root / "_log").glob("*.json") if p.stem.isdigit())
    files = {"commit": logs[-1:] if how == "delete-last" else logs[:-1] if how == "delete-middle" else logs,
             "snapshot": sorted((case.root / "_snapshots").glob("*.safetensors")),
             "pointer": [case.root / "index.json"], "shard": sorted(case.root.glob("*/r*.safetensors")),
             "prompts": sorted(case.root.glob("prompts-*.safetensors"))}[what]
    files = [p for p in files if p.is_file() and not p.is_symlink() and not p.parent.is_symlink()]
    if not files or (how == "delete-last" and case.newest - 1 not in case.gens):
        return  # (the model knows the generation before the last only when one commit made the last)
    path = case.rng.choice(files)
    original = path.read_bytes()
    if how == "truncate":
        path.write_bytes(original[: case.rng.randrange(len(original))])
    elif how == "flip":
        at = case.rng.randrange(len(original))
        path.write_bytes(original[:at] + bytes([original[at] ^ (1 << case.rng.randrange(8))]) + original[at + 1:])
        how = f"flip byte {at}"
    else:
        path.unlink()
    case.note(f"damage {path.relative_to(case.root)}: {how}")
    # with its last commit gone, a log reads as one generation shorter: nothing can tell
    shorter = case.gens.get(case.newest - 1) if how == "delete-last" else None
    damaged_reads(case, shorter)
    # gc or a writer that finds nothing to do, while the file is damaged, must not lose anything the model holds
    action = case.rng.choice(["gc", "writer", "none"]) if how != "delete-last" else "none"
    if action == "gc" and kind == "snapshot-delete" and "gc-lost-snapshot" not in case.kinds:
        action = "writer"
    collected = False  # gc ran to its end: the log and snapshots before the oldest generation kept are gone
    if action != "none":
        case.note(f"  {action} while damaged")
        try:
            with Process():
                if action == "gc":
                    gc(case.root)
                    collected = True
                else:
                    ShardWriter(case.root, FINGERPRINT, SCHEMA).finish()
        except Exception as e:
            if not refusal(e, case.root):
                raise Broken(f"{action} while {path.name} is damaged raised {type(e).__name__}: {e}") from e
            case.note(f"  refused: {str(e)[:120]}")
    oldest = min(snapshots(case.root), default=-1)
    if path.exists() or not (collected and what in ("commit", "snapshot") and int(path.stem) < oldest):
        path.write_bytes(original)  # undone, unless it is log gc collected
        case.note("  restored")
    case.check_foreign(f"after damage to {path.name}")


def damaged_reads(case, shorter: State | None) -> None:
    """Each reader reads exactly the generation the model has, or refuses; `verify` never raises and reports
    every damage a reader refuses."""
    for g in [None, *sorted(case.needed())]:
        want = [(case.newest if g is None else g, case.state if g is None else case.gens[g])]
        if g is None and shorter is not None:
            want.append((case.newest - 1, shorter))
        try:
            got = read(case.root, g)
        except Broken:
            raise
        except Exception as e:
            if not refusal(e, case.root):
                raise Broken(f"a reader of generation {g} raised {type(e).__name__}: {e}") from e
            case.note(f"  reader of {'the newest' if g is None else g} refused: {str(e)[:120]}")
            if g is None:
                try:
                    report = verify(case.root)
                except Exception as e2:
                    raise Broken(f"verify raised {type(e2).__name__}: {e2}") from e2
                if report.ok:
                    raise Broken(f"verify finds nothing wrong, a reader refuses: {e}") from None
            continue
        if got not in want:
            raise Broken(f"a reader of generation {g} reads generation {got[0]} of a damaged cache, not exactly "
                         f"generation {want[0][0]}: {difference(got[1], want[0][1])}")
