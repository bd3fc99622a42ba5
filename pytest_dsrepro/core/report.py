"""``--ds-report``: a run record rendered as Markdown that can be pasted into a GitHub issue as it is.

``render_markdown`` is a pure function of the run record that ``results.Run.as_json`` builds (the same data
``--ds-results`` writes), so it is tested on hand-built records. Long parts (configs, tracebacks, rank output) are
folded in ``<details>`` so the issue reads top-down: environment, a summary table, then one section per test.
"""

from __future__ import annotations

import html
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .gates import oldest_first

#: GitHub refuses issue bodies over 65536 characters; one folded block never takes more than this.
BLOCK_LIMIT = 12_000

_ENV_ROWS = (
    ("DeepSpeed", "deepspeed"),
    ("torch", "torch"),
    ("Python", "python"),
    ("Backend", "backend"),
    ("World size", "world_size"),
    ("OS", "os"),
)


def _fence(text: str, lang: str = "") -> str:
    """A fenced code block that survives backticks inside ``text``."""
    longest = max((len(m) for m in re.findall(r"`{3,}", text)), default=2)
    fence = "`" * (longest + 1)
    return f"{fence}{lang}\n{text.rstrip()}\n{fence}"


def _clip(text: str, limit: int = BLOCK_LIMIT) -> str:
    """Keep the end of ``text`` (where a traceback's exception and a log's last words are)."""
    if len(text) <= limit:
        return text
    cut = len(text) - limit
    return f"[... {cut} characters cut ...]\n" + text[cut:]


def _details(summary: str, body: str) -> str:
    return f"<details><summary>{html.escape(summary)}</summary>\n\n{body}\n\n</details>"


def _cell(value: object) -> str:
    """A Markdown table cell: one line, pipes escaped."""
    text = " ".join(str(value).split())
    return text.replace("|", "\\|") if text else "-"


def _code(value: object) -> str:
    text = " ".join(str(value).split())
    ticks = "``" if "`" in text else "`"
    pad = " " if ticks == "``" else ""
    return f"{ticks}{pad}{text}{pad}{ticks}"


# --- ranks -----------------------------------------------------------------------------------------------------


def _rank_numbers(label: str) -> list[int] | None:
    """``"ranks 0-1,3"``, ``"rank 2"`` or ``"0-1"`` -> ``[0, 1, 3]``; None when the label is not a rank list."""
    body = re.sub(r"^\s*ranks?\s*", "", label).strip()
    if not re.fullmatch(r"\d+(-\d+)?(\s*,\s*\d+(-\d+)?)*", body):
        return None
    numbers: list[int] = []
    for part in body.split(","):
        lo, _, hi = part.strip().partition("-")
        numbers.extend(range(int(lo), int(hi or lo) + 1))
    return numbers


def rank_label(numbers: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"ranks 0-2,5"``; ``[3]`` -> ``"rank 3"``."""
    ordered = sorted(set(numbers))
    parts: list[str] = []
    start = prev = None
    for n in [*ordered, None]:
        if n is not None and prev is not None and n == prev + 1:
            prev = n
            continue
        if start is not None:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = n
    return ("rank " if len(ordered) == 1 else "ranks ") + ",".join(parts)


def dedupe_ranks(groups: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Merge rank groups that ended the same way (same error and traceback) into one, labels joined.

    The plugin already groups identical ranks; this also merges records written one rank at a time, and keeps
    the order in which each distinct ending first appears.
    """
    merged: dict[tuple[str, str], dict[str, Any]] = {}
    for group in groups:
        key = (str(group.get("error") or ""), str(group.get("traceback") or ""))
        label = str(group.get("ranks") or "")
        if key not in merged:
            merged[key] = {**group, "_labels": [label]}
        else:
            merged[key]["_labels"].append(label)
    out = []
    for group in merged.values():
        labels: list[str] = group.pop("_labels")
        numbers = [_rank_numbers(label) for label in labels]
        if all(n is not None for n in numbers):
            group["ranks"] = rank_label(n for ns in numbers if ns is not None for n in ns)
        else:
            group["ranks"] = ", ".join(labels)
        out.append(group)
    return out


# --- sections --------------------------------------------------------------------------------------------------


def _environment(env: Mapping[str, Any]) -> list[str]:
    lines = ["### Environment", "", "| | |", "|---|---|"]
    for title, key in _ENV_ROWS:
        lines.append(f"| {title} | {_cell(env.get(key) if env.get(key) is not None else 'not installed')} |")
    cpu = env.get("cpu") or "unknown"
    if env.get("cpu_count"):
        cpu = f"{cpu} ({env['cpu_count']} cores)"
    lines.append(f"| CPU | {_cell(cpu)} |")
    gpu = f"{env['gpu_count']} x {env['gpu']}" if env.get("gpu_count") else "none"
    lines.append(f"| GPU | {_cell(gpu)} |")
    return lines


def _label(test: Mapping[str, Any]) -> str:
    return str(test.get("verdict") or str(test.get("outcome") or "unknown").upper())


def _summary(tests: Sequence[Mapping[str, Any]]) -> list[str]:
    lines = ["### Summary", "", "| Test | Verdict | Outcome | Duration |", "|---|---|---|---|"]
    for t in tests:
        lines.append(
            f"| {_code(t.get('nodeid', '?'))} | {_cell(_label(t))} | {_cell(t.get('outcome'))} "
            f"| {float(t.get('duration') or 0):.1f} s |"
        )
    return lines


def _repro(repro: Mapping[str, Any] | None) -> list[str]:
    if not repro:
        return ["Not a catalogued repro (no `ds_repro` marker)."]
    upstream = repro.get("upstream")
    lines = [f"- **Repro:** `{repro.get('id')}` - {repro.get('title') or '(no title)'}"]
    if upstream:
        lines.append(f"- **Upstream:** {upstream}")
    affected = oldest_first(str(a) for a in repro.get("affected") or [] if a)
    if affected:
        lines.append("- **Affected:** " + " or ".join(f"`deepspeed{a}`" for a in affected))
    fixed = repro.get("fixed_in")
    fix_ref = repro.get("fix_ref")
    fixed_text = f"{fixed}" if fixed else "no release yet"
    lines.append(f"- **Fixed in:** {fixed_text}" + (f" ({fix_ref})" if fix_ref else ""))
    if repro.get("root_cause"):
        lines.append(f"- **Root cause:** {' '.join(str(repro['root_cause']).split())}")
    return lines


def _config(test: Mapping[str, Any]) -> list[str]:
    lines: list[str] = []
    notes = test.get("config_notes") or []
    if notes:
        lines.append("- **Config adapted to this world:** " + "; ".join(str(n) for n in notes))
    config = test.get("config")
    if config is not None:
        body = _fence(json.dumps(config, indent=2, sort_keys=True, default=str), "json")
        lines += ["", _details("Resolved DeepSpeed config", body)]
    return lines


def _failures(test: Mapping[str, Any]) -> list[str]:
    groups = dedupe_ranks(test.get("ranks") or [])
    lines: list[str] = []
    if len(groups) > 1:
        lines += ["", f"The ranks ended in {len(groups)} different ways:"]
    for g in groups:
        label = str(g.get("ranks") or "ranks")
        lines += ["", f"**{label}:** {_code(g.get('error') or 'no error recorded')}"]
        if g.get("traceback"):
            lines += ["", _details(f"Traceback ({label})", _fence(_clip(str(g["traceback"])), "pytb"))]
        if g.get("output"):
            lines += ["", _details(f"Output of {label} (tail)", _fence(_clip(str(g["output"]))))]
    if not groups and test.get("longrepr"):
        lines += ["", _details("Failure", _fence(_clip(str(test["longrepr"]))))]
    return lines


def _test(test: Mapping[str, Any]) -> list[str]:
    head = f"### {_label(test)}: {_code(test.get('nodeid', '?'))}"
    lines = [head, "", *_repro(test.get("repro"))]
    outcome = f"- **Outcome:** {test.get('outcome')} in {float(test.get('duration') or 0):.1f} s"
    if test.get("variant"):
        outcome += f" ({test['variant']} variant)"
    lines.append(outcome)
    if test.get("error"):
        lines.append(f"- **Result:** {_code(test['error'])}")
    lines += _config(test)
    lines += _failures(test)
    return lines


def _counts(tests: Sequence[Mapping[str, Any]]) -> str:
    counts: dict[str, int] = {}
    for t in tests:
        counts[_label(t)] = counts.get(_label(t), 0) + 1
    return ", ".join(f"{n} {label.lower()}" for label, n in counts.items()) or "no tests"


def render_markdown(run: Mapping[str, Any]) -> str:
    """The whole report; paste it into an issue as it is."""
    env = run.get("environment") or {}
    tests = run.get("tests") or []
    world = f"{env.get('world_size', '?')} ranks, {env.get('backend') or '?'}"
    lines = [
        "## pytest-dsrepro report",
        "",
        f"DeepSpeed {env.get('deepspeed') or 'not installed'}, torch {env.get('torch') or 'not installed'}, "
        f"{world}: {_counts(tests)}." + (f" Run at {run['created']}." if run.get("created") else ""),
    ]
    unavailable = run.get("unavailable")
    if unavailable:
        why = unavailable.get("reason") or unavailable if isinstance(unavailable, Mapping) else unavailable
        lines += ["", f"> **DeepSpeed was not available for this run:** {' '.join(str(why).split())}"]
    lines += ["", *_environment(env)]
    if tests:
        lines += ["", *_summary(tests)]
    for test in tests:
        lines += ["", *_test(test)]
    lines += ["", "<sub>Generated by pytest-dsrepro (`pytest --ds-report`).</sub>", ""]
    return "\n".join(lines)
