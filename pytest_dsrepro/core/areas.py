"""The catalogue's layout: ``repros/`` has a folder per DeepSpeed subsystem, and a repro lives in the folder of the
subsystem its bug is in (where the fix goes, not what its config turns on), except the bugs met through Hugging
Face's integration, which share ``hf/`` (the path their users take, and the extra they need). ``dsrepro list`` and
docs/repros.md group by these folders, under their headings; ``dsrepro new`` picks one from a new repro's name.

The helpers the repros share (``_zero12.py``, ``_prerequisites.py``, ...) stay at the top of ``repros/``, beside its
``conftest.py``, and import by plain name from any depth; the price is that no two repros may share a file name
(``namesake``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path, PurePosixPath


@dataclass(frozen=True)
class Area:
    """A folder of ``repros/``: what a reader calls it, and the names of new repros that go there by default."""

    folder: str
    heading: str
    prefixes: tuple[str, ...] = ()


#: In the order ``dsrepro list`` and docs/repros.md show them; a folder not listed here comes after them, by name.
AREAS = (
    Area("zero12", "ZeRO stages 1 and 2", ("zero12-", "zero1-", "zero2-")),
    Area("zero3", "ZeRO stage 3", ("zero3-",)),
    Area("checkpoint", "Checkpointing", ("checkpoint-", "ckpt-", "universal-")),
    Area("pipeline", "Pipeline parallelism", ("pipeline-", "pipe-")),
    Area("optim", "Optimizers and learning-rate schedulers", ("optim-", "sched-", "lr-")),
    Area("precision", "Mixed precision: the fp16 and bf16 optimizers", ("fp16-", "bf16-")),
    Area("hf", "The Hugging Face path: transformers, accelerate, PEFT", ("hf-",)),
    Area("moe", "Mixture of experts", ("moe-",)),
    Area("sequence", "Sequence parallelism", ("sequence-", "ulysses-", "sp-")),
    Area("engine", "The engine: communication, profiling, monitors, config", ("engine-", "comm-", "comms-")),
)
_BY_FOLDER = {area.folder: area for area in AREAS}


def folder(path: str | Path, top: str | Path) -> str:
    """The folder of the repro at ``path`` under the catalogue's ``top`` directory, ``zero3`` or ``zero3/offload``
    (``""``: at the top, or not under it)."""
    try:
        within = Path(path).parent.relative_to(top)
    except ValueError:
        return ""
    return "" if within == Path() else within.as_posix()


def heading(name: str) -> str:
    """What a folder is called: its area's heading (``ZeRO stage 3``), a sub-folder's after it (``ZeRO stage 3:
    offload``); a folder of no area by its own name."""
    first, _, rest = name.partition("/")
    area = _BY_FOLDER.get(first)
    if area is None:
        return name
    return f"{area.heading}: {rest}" if rest else area.heading


def order(name: str) -> tuple[int, str]:
    """A sort key for folders: the top first, then the areas in ``AREAS`` order, then the others by name."""
    if not name:
        return -1, ""
    first = name.partition("/")[0]
    index = next((i for i, area in enumerate(AREAS) if area.folder == first), len(AREAS))
    return index, name


def area_for(name: str) -> Area | None:
    """The area a new repro named ``name`` (``zero3-foo``) belongs to by its prefix, if one fits."""
    return next((area for area in AREAS if name.startswith(area.prefixes)), None)


def namesake(path: Path, top: Path) -> str | None:
    """Why the repro at ``path`` cannot be imported as itself: another file under ``top`` has its name. None if
    none has.

    pytest's default (``prepend``) import mode puts the top folder on ``sys.path`` with the conftest, and each repro's
    own folder with the repro, so ``from _zero12 import ...`` works from any depth, in the ranks too (they get the
    pytest process's ``sys.path``). The price: a repro is imported as a top-level module named after its file."""
    others = sorted(other for other in top.rglob(path.name) if other.is_file() and other != path)
    if not others:
        return None
    shown = [str(PurePosixPath(top.name, p.relative_to(top).as_posix())) for p in [path, *others]]
    return (
        f"{', '.join(shown[:-1])} and {shown[-1]} have the same file name: pytest imports every repro as a top-level "
        f"module named after its file ({top.name}/ has no __init__.py: its default prepend import mode), so one "
        f"would stand in for the other. Rename one: a repro's file name is unique across {top.name}/, whatever its "
        "folder."
    )
