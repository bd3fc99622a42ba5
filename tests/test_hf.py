"""The Hugging Face path: repros that need the hf extra say so where it is missing, and its tiny-model helpers build
every architecture from a config, without a download."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conftest import RunPytest
from pytest_dsrepro.inrank import hf
from pytest_dsrepro.tools import cli

#: A catalogued repro that needs transformers, in a session where it cannot be imported (as without the extra).
WITHOUT_TRANSFORMERS = """
import sys

sys.modules["transformers"] = None  # what find_spec reports for a package that is not installed
"""
HF_REPRO = """
import os

import pytest

from pytest_dsrepro.inrank.hf import requires_hf

pytestmark = [pytest.mark.ds_repro(id="hf-x", title="x", upstream="https://u"), requires_hf]


def fail_the_fix(monkeypatch):
    raise RuntimeError("never applied: the test is skipped before any world")


@pytest.mark.ds_world
@pytest.mark.ds_version(affected=">=0", raises=RuntimeError, fix=fail_the_fix)
def test_needs_transformers(ds_rank):
    os.kill(os.getpid(), 9)  # never runs
"""


def test_without_the_extra_hf_repros_are_skipped_naming_it(pytester: pytest.Pytester, run: RunPytest) -> None:
    """Listed as usual, and skipped (both variants) with the missing package and the extra to install, in the
    verdicts too; no world is started."""
    pytester.makeconftest(WITHOUT_TRANSFORMERS)
    pytester.makepyfile(HF_REPRO)
    result = run("-rs")
    result.assert_outcomes(skipped=2)
    reason = "needs transformers from the hf extra: pip install 'pytest-dsrepro[[]hf[]]'"
    result.stdout.fnmatch_lines(
        ["*= dsrepro verdicts *", f"SKIPPED  *[[]stock[]]  -- {reason}", f"SKIPPED [[]2[]] *: {reason}"]
    )
    assert "worlds ran on" not in result.stdout.str()


def test_the_extra_is_what_the_helpers_look_for() -> None:
    """The packages ``requires_hf`` checks are the ``hf`` extra of the distribution (one list, in pyproject)."""
    from importlib.metadata import requires

    extra = {r.split(">")[0].split("=")[0].strip() for r in requires("pytest-dsrepro") or [] if 'extra == "hf"' in r}
    assert extra == set(hf.HF_PACKAGES)
    assert hf.missing_hf_packages() == []  # the test environment installs the extra


@pytest.mark.parametrize("model_type", sorted(hf.TINY_CONFIGS))
def test_tiny_models_build_train_and_round_trip(model_type: str, tmp_path: Path) -> None:
    """Each tiny architecture builds from its config alone, gives a finite loss with gradients everywhere (the MoE's
    experts included), is the same for the same seed, and ``save_tiny`` + ``from_pretrained(local_files_only=True)``
    gives back the same weights."""
    import torch
    from transformers import AutoModelForCausalLM

    model = hf.tiny_model(model_type, seed=1)
    batch = hf.token_batch(2, seed=3)
    loss = model(**batch).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert sum(p.numel() for p in model.parameters()) < 100_000
    if model_type == "mixtral":  # routed experts: each expert of each layer got a gradient for some token
        experts = [p for n, p in model.named_parameters() if "experts" in n]
        assert experts
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in experts)
    same = hf.tiny_model(model_type, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), same.state_dict().values(), strict=True))

    path = hf.save_tiny(tmp_path / model_type, model_type, seed=1)
    loaded = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    expected = same.state_dict()
    assert {k: v for k, v in loaded.state_dict().items() if not torch.equal(v, expected[k])} == {}


def test_sequence_classification_and_unknown_types() -> None:
    model = hf.tiny_model("llama", task="sequence-classification", num_labels=1)
    assert model.score.out_features == 1
    with pytest.raises(ValueError, match="no tiny config for 'bert'; known: llama, gpt2, mixtral"):
        hf.tiny_config("bert")


def test_an_hf_repro_exports_to_a_script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A maintainer's script for a bug met through PEFT imports peft and transformers, and the helpers inlined."""
    monkeypatch.chdir(Path(__file__).parents[1])
    nodeid = "repros/hf/test_hf_peft_modules_to_save.py::test_lora_with_modules_to_save_trains[zero3-stock]"
    script = tmp_path / "repro.py"
    assert cli.main(["export", nodeid, "-o", str(script)]) == 0
    text = script.read_text()
    assert "def tiny_model(" in text
    imported = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    assert {"peft", "transformers"} <= imported
    assert not imported & {"pytest", "pytest_dsrepro"}
