"""``dsrepro new``: a repro file from the template, which runs (and passes) at once and says what to fill in."""

from __future__ import annotations

import builtins
import json
import re
import shlex
import string
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ..core import areas
from ..core.configs import PRESETS
from ..triage.logread import Reading

DEFAULT_PRESET = "zero3"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9 _.-]*")


class ScaffoldError(Exception):
    """A bad name, preset or issue URL, or a file that exists; the message says which and why."""


@dataclass(frozen=True)
class Names:
    id: str  # catalogue id, kebab-case: "zero3-module-id"
    slug: str  # snake_case: file test_<slug>.py, function test_<slug>


def names(name: str) -> Names:
    """``"ZeRO3 module.id"`` -> ``Names(id="zero3-module-id", slug="zero3_module_id")``."""
    stem = name.strip()
    stem = stem.removesuffix(".py")
    stem = stem.removeprefix("test_")
    if not _NAME.fullmatch(stem):
        raise ScaffoldError(
            f"invalid NAME {name!r}: use letters, digits, spaces, '-', '_' or '.', starting with a letter or digit "
            "(e.g. zero3-module-id)"
        )
    words = [w for w in re.split(r"[^a-z0-9]+", stem.lower()) if w]
    return Names(id="-".join(words), slug="_".join(words))


@dataclass(frozen=True)
class Prefill:
    """What a new repro starts from: the ``ds_repro`` title and the gate's exception and message, as Python source."""

    title: str = json.dumps("TODO: what goes wrong, in one line")
    raises: str = "AttributeError"
    match: str = json.dumps("TODO")
    issue: str | None = None


def prefill(reading: Reading) -> Prefill:
    """A repro's start from a log's error (``triage.logread``): its type where it is a built-in exception (else
    ``Exception``: the gate then judges by the message), its first line escaped as ``match``, the first DeepSpeed issue
    the text links. ``ScaffoldError`` when the log shows no exception."""
    error = reading.primary
    if error is None:
        raise ScaffoldError("the log shows no exception (no traceback, no `...Error: message` line) to prefill from")
    found = getattr(builtins, error.name, None)
    raises = error.name if isinstance(found, type) and issubclass(found, BaseException) else "Exception"
    first = error.message.split("\n", 1)[0][:100]
    frame = error.innermost_deepspeed
    where = f" (at {frame.path} in {frame.function})" if frame else ""
    title = f"TODO, from the log: {error.name}{where}: {first[:60]}"
    match = repr(re.escape(first).replace("\\ ", " ")) if first else "None"
    return Prefill(json.dumps(title), raises, match, next(iter(reading.issues), None))


def check_preset(preset: str) -> str:
    if preset not in PRESETS:
        raise ScaffoldError(f"unknown preset {preset!r}; presets: {', '.join(PRESETS)}")
    return preset


def check_issue(url: str | None) -> str | None:
    if url is not None and not re.fullmatch(r"https?://\S+", url):
        raise ScaffoldError(f"--issue {url!r} is not a URL; give the issue's address, e.g. https://github.com/...")
    return url


def render(
    name: str, path: Path, issue: str | None = None, preset: str = DEFAULT_PRESET, start: Prefill = Prefill()
) -> str:
    """The text of a new repro file (pure apart from reading the template). Its ``ds_premise`` starts as the preset's
    ZeRO stage, which its own config meets; ``start`` prefills the title and the gate (``prefill``)."""
    n = names(name)
    template = string.Template(resources.files("pytest_dsrepro.tools").joinpath("templates/repro.py.tmpl").read_text())
    upstream = json.dumps(issue) if issue else '"TODO: https://github.com/deepspeedai/DeepSpeed/issues/NNNN"'
    return template.substitute(
        title_doc=f"Repro {n.id}: TODO one line on what goes wrong.",
        name=shlex.quote(name),
        path=path.as_posix(),
        test=f"test_{n.slug}",
        id=n.id,
        upstream=upstream,
        preset=preset,
        stage=PRESETS[preset]["zero_optimization"]["stage"],
        title=start.title,
        raises=start.raises,
        match=start.match,
    )


def target(name: str, directory: Path) -> Path:
    return directory / f"test_{names(name).slug}.py"


def folder_for(name: str, catalogue: Path) -> Path:
    """Where a new repro goes when no directory is given: in a catalogue laid out by subsystem (``core.areas``), the
    folder of the one its name begins with (``zero3-foo``: ``repros/zero3``); in one that is not, its top.
    ``ScaffoldError`` for a name that begins with no subsystem's, in a catalogue that has them."""
    laid_out = [area.folder for area in areas.AREAS if (catalogue / area.folder).is_dir()]
    area = areas.area_for(names(name).id)
    if not laid_out:
        return catalogue
    if area is not None:
        return catalogue / area.folder
    raise ScaffoldError(
        f"{names(name).id!r} begins with no subsystem's name (zero3-..., checkpoint-...: core/areas.py lists them): "
        f"give --dir {catalogue}/FOLDER, the folder of the DeepSpeed subsystem the bug is in ({', '.join(laid_out)})"
    )


def create(
    name: str,
    directory: Path = Path("repros"),
    issue: str | None = None,
    preset: str = DEFAULT_PRESET,
    start: Prefill = Prefill(),
    catalogue: Path | None = None,
) -> Path:
    """Write ``directory/test_<slug>.py``; never overwrite (``ScaffoldError`` names the file that exists), nor write
    a file whose name one under ``catalogue`` (which holds ``directory``) has already."""
    issue = issue or start.issue
    check_issue(issue)
    check_preset(preset)
    path = target(name, directory)
    problem = areas.namesake(path.resolve(), catalogue.resolve()) if catalogue and not path.exists() else None
    if problem is not None:
        raise ScaffoldError(f"not writing {path}: {problem}")
    text = render(name, path, issue, preset, start)
    directory.mkdir(parents=True, exist_ok=True)
    try:
        with path.open("x", encoding="utf-8") as f:  # "x": the check and the creation are one step
            f.write(text)
    except FileExistsError:
        raise ScaffoldError(f"{path} already exists; not overwriting it (choose another NAME or remove it)") from None
    return path
