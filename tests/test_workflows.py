"""The GitHub workflows the docs offer, as a user copies them (issue 49 item 7; issue 52 item 5; issue 53 item 6):
DeepSpeed's tests in shards (docs/upstream.md), the catalogue's matrix of releases x shards (docs/matrix.md), and
triage on the tracker (docs/triage.md). Each is valid against GitHub's workflow schema (check-jsonschema's copy, no
network), least privileged, pinned, clean under zizmor's offline audits; the triage workflow's steps run here on a
real report in the payload GitHub sends for an opened issue, with ``gh`` recorded instead of called."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import ROOT

yaml = pytest.importorskip("yaml")  # transformers' dependency (the hf extra), in the test environment

#: Each documented workflow: the doc that offers it, and its first line there.
DOCUMENTED = {
    "upstream": ("upstream.md", "name: DeepSpeed tests/unit on CPU worlds"),
    "matrix": ("matrix.md", "name: dsrepro catalogue matrix"),
    "triage": ("triage.md", "name: dsrepro triage"),
}
BIN = Path(sys.executable).parent  # the test extra's tools (zizmor, check-jsonschema) are in the environment


def _documented(name: str) -> str:
    doc, first = DOCUMENTED[name]
    text = (ROOT / "docs" / doc).read_text()
    start = text.index(first)
    return text[start : text.index("```", start)]


def _steps(workflow: dict[str, Any]) -> list[dict[str, Any]]:
    return [step for job in workflow["jobs"].values() for step in job["steps"]]


@pytest.fixture(params=sorted(DOCUMENTED))
def copied(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """A documented workflow as a user saves it: ``.github/workflows/<name>.yml``."""
    path = tmp_path / ".github" / "workflows" / f"dsrepro-{request.param}.yml"
    path.parent.mkdir(parents=True)
    path.write_text(_documented(request.param))
    return path


def test_a_documented_workflow_pins_its_actions_and_keeps_no_credentials(copied: Path) -> None:
    workflow = yaml.safe_load(copied.read_text())
    uses = [step["uses"] for step in _steps(workflow) if "uses" in step]
    assert uses
    assert all(re.fullmatch(r"actions/[a-z-]+@[0-9a-f]{40}", u) for u in uses), uses
    checkouts = [step for step in _steps(workflow) if step.get("uses", "").startswith("actions/checkout@")]
    assert all(step["with"]["persist-credentials"] is False for step in checkouts)


def test_a_documented_workflow_is_valid_for_github(copied: Path) -> None:
    checked = subprocess.run(
        [str(BIN / "check-jsonschema"), "--builtin-schema", "vendor.github-workflows", str(copied)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_a_documented_workflow_is_clean_under_zizmor(copied: Path) -> None:
    zizmor = subprocess.run([str(BIN / "zizmor"), "--offline", "--no-progress", str(copied)], capture_output=True,
                            text=True, timeout=120)  # fmt: skip
    assert zizmor.returncode == 0, zizmor.stdout + zizmor.stderr
    assert "No findings to report" in zizmor.stdout


def test_the_workflows_tokens_are_least_privileged() -> None:
    """Reading is all the matrix and the shards need; triage's token may do nothing but comment, and only in its job."""
    permissions = {name: yaml.safe_load(_documented(name))["permissions"] for name in DOCUMENTED}
    assert permissions == {"upstream": {"contents": "read"}, "matrix": {"contents": "read"}, "triage": {}}
    jobs = yaml.safe_load(_documented("triage"))["jobs"]
    assert {name: job.get("permissions") for name, job in jobs.items()} == {"triage": {"issues": "write"}}


def test_the_matrix_runs_every_release_of_releases_txt_in_slices_and_merges_them() -> None:
    workflow = yaml.safe_load(_documented("matrix"))
    listing = workflow["jobs"]["releases"]["steps"][-1]["run"]
    listed = subprocess.run(["bash", "-c", listing], cwd=ROOT, env={**os.environ, "GITHUB_OUTPUT": "/dev/stdout"},
                            capture_output=True, text=True, check=True).stdout  # fmt: skip
    releases = json.loads(listed.removeprefix("releases="))
    assert releases == [line for line in (ROOT / "releases.txt").read_text().splitlines() if not line.startswith("#")]
    slice_ = workflow["jobs"]["slice"]
    shards = slice_["strategy"]["matrix"]["shard"]
    run = next(step for step in slice_["steps"] if "tox -e" in step.get("run", ""))
    assert f'--ds-shard "$SHARD/{len(shards)}"' in run["run"]
    env = subprocess.run(["bash", "-c", 'echo "ds${RELEASE//./}"'], env={"RELEASE": "0.16.3"}, capture_output=True,
                         text=True, check=True).stdout.strip()  # fmt: skip
    assert env == "ds0163"  # toxfile.py's name for the release
    merge = " ".join(step.get("run", "") for step in workflow["jobs"]["merge"]["steps"])
    assert "dsrepro matrix artifacts/*/" in merge
    assert workflow["jobs"]["merge"]["if"] == "always()"  # a dead slice is named by the merge, not hidden by it


# ---- triage on the tracker, run here -------------------------------------------------------------------------------


def _issue_event(report: str, number: int, action: str = "opened", label: str | None = None) -> dict[str, Any]:
    """The payload GitHub gives a workflow for an issue event, around a real report of corpus/reports (its title is
    the text's first line, as the corpus keeps it)."""
    title, _, body = (ROOT / "corpus" / "reports" / "texts" / f"{report}.txt").read_text().partition("\n")
    repo = {"full_name": "deepspeedai/DeepSpeed", "name": "DeepSpeed", "owner": {"login": "deepspeedai"}}
    issue = {
        "number": number, "title": title, "body": body.strip() or None, "state": "open",
        "html_url": f"https://github.com/deepspeedai/DeepSpeed/issues/{number}",
        "user": {"login": "reporter"}, "labels": [{"name": label}] if label else [],
    }  # fmt: skip
    event = {"action": action, "issue": issue, "repository": repo, "sender": {"login": "reporter"}}
    return event | ({"label": {"name": label}} if label else {})


def _expression(text: str, event: dict[str, Any]) -> str:
    """The ``${{ github.event.* }}`` and ``${{ github.token }}`` a step's env uses, as the runner fills them."""

    def value(found: re.Match[str]) -> str:
        path = found.group(1)
        if path == "github.token":
            return "a-token"
        node: Any = event
        for key in path.removeprefix("github.event.").split("."):
            node = node[key]
        return str(node)

    return re.sub(r"\$\{\{\s*([\w.]+)\s*\}\}", value, text)


def _job_runs(event: dict[str, Any]) -> bool:
    """The triage job's ``if``, for the two events it is written for."""
    condition = yaml.safe_load(_documented("triage"))["jobs"]["triage"]["if"]
    assert condition == "github.event.action == 'opened' || github.event.label.name == 'bug'"
    return bool(event["action"] == "opened" or event.get("label", {}).get("name") == "bug")


def _run_triage_job(tmp_path: Path, event: dict[str, Any]) -> tuple[list[list[str]], str]:
    """The triage job's steps after its installs, in order, as the runner runs them (bash, the step's env, the
    event's payload file, a GITHUB_OUTPUT file): the ``gh`` calls it made, and the comment it wrote."""
    (tmp_path / "event.json").write_text(json.dumps(event))
    recorder = tmp_path / "bin" / "gh"
    recorder.parent.mkdir()
    recorder.write_text(f'#!/bin/sh\nprintf "%s\\0" "$@" >> {tmp_path / "gh-calls"}\nprintf "\\n" >> '
                        f'{tmp_path / "gh-calls"}\n')  # fmt: skip
    recorder.chmod(0o755)
    outputs = tmp_path / "output"
    outputs.touch()
    base = {**os.environ, "PATH": f"{recorder.parent}:{BIN}:{os.environ['PATH']}", "GITHUB_OUTPUT": str(outputs),
            "GITHUB_EVENT_PATH": str(tmp_path / "event.json"), "GITHUB_REPOSITORY": "deepspeedai/DeepSpeed"}  # fmt: skip
    for step in yaml.safe_load(_documented("triage"))["jobs"]["triage"]["steps"]:
        if "run" not in step or step.get("name") == "install":  # the test environment has both installs
            continue
        if "if" in step:
            assert step["if"] == "steps.triage.outputs.status == '0'"
            if "status=0" not in outputs.read_text().splitlines():
                continue
        env = base | {key: _expression(str(value), event) for key, value in step.get("env", {}).items()}
        ran = subprocess.run(["bash", "-e", "-c", step["run"]], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=300)  # fmt: skip
        assert ran.returncode == 0, f"step {step.get('name')}: {ran.stdout}{ran.stderr}"
    calls = (tmp_path / "gh-calls").read_text() if (tmp_path / "gh-calls").exists() else ""
    comment = tmp_path / "comment.md"
    return [line.strip("\0").split("\0") for line in calls.splitlines() if line], (
        comment.read_text() if comment.exists() else ""
    )


def test_a_new_issue_of_a_known_bug_gets_triages_comment(tmp_path: Path) -> None:
    """DeepSpeed issue #3024, opened: the ZeRO-3 engine without an optimizer, named with confidence; the comment
    posted is the Markdown triage wrote, on that issue."""
    event = _issue_event("ds-3024", 3024)
    assert _job_runs(event)
    calls, comment = _run_triage_job(tmp_path, event)
    assert calls == [["issue", "comment", "3024", "--repo", "deepspeedai/DeepSpeed", "--body-file", "comment.md"]]
    assert "zero3-backward-without-optimizer" in comment


def test_an_issue_triage_cannot_place_gets_no_comment(tmp_path: Path) -> None:
    """DeepSpeed issue #1218 (another cause): triage names nothing with confidence, so nothing is posted, and the
    job still passes."""
    calls, _ = _run_triage_job(tmp_path, _issue_event("ds-1218", 1218))
    assert calls == []


def test_the_triage_job_runs_on_an_issue_opened_or_labelled_bug_only() -> None:
    assert _job_runs(_issue_event("ds-1218", 1218, action="labeled", label="bug"))
    assert not _job_runs(_issue_event("ds-1218", 1218, action="labeled", label="question"))
    events = yaml.safe_load(_documented("triage"))[True]  # YAML 1.1 reads the key `on` as true
    assert events == {"issues": {"types": ["opened", "labeled"]}}
