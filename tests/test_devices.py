"""Bodies put their data on their rank's device: ``ds_device``, the helpers' defaults, and the catalogue's check that
sees, on a CPU machine, a tensor that a GPU would have left on the CPU."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from conftest import RunPytest

ROOT = Path(__file__).resolve().parent.parent

#: ``make_batch`` as the catalogue had it before ``ds_device`` (commit 301be20), its batch left on the CPU; it takes
#: the ``dtype`` today's body passes.
HELPER_BEFORE_DEVICES = """
def make_batch(batch_size, hidden=16, seed=0, rank=0, dtype=None):
    import torch

    generator = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn(batch_size, hidden, generator=generator).to(dtype)
    return x, x.sum(dim=-1, keepdim=True) * 0.1
"""


def catalogue_copy(pytester: pytest.Pytester, *files: str) -> Path:
    """A ``repros/`` directory in the pytester tree with the catalogue's conftest (its device check) and ``files``."""
    repros = pytester.mkdir("repros")
    for name in ("conftest.py", *files):
        shutil.copy(ROOT / "repros" / name, repros / name)
    return repros


def test_ds_device_and_helpers_follow_the_rank(pytester: pytest.Pytester, run: RunPytest) -> None:
    """In a gloo world ``ds_device`` is the CPU, and the helpers put their tensors and models there unasked."""
    catalogue_copy(pytester)
    pytester.makepyfile(
        **{
            "repros/test_where": """
            def test_where(ds_device):
                import torch
                from pytest_dsrepro.inrank.devices import precision_dtype
                from pytest_dsrepro.inrank.models import make_batch, tiny_mlp

                assert ds_device == "cpu"
                x, y = make_batch(2, dtype=precision_dtype({"bf16": {"enabled": True}}))
                assert (x.device.type, x.dtype, y.dtype) == ("cpu", torch.bfloat16, torch.bfloat16)
                assert next(tiny_mlp().parameters()).device.type == "cpu"
                assert torch.ones(2, device=ds_device).device.type == "cpu"
            """
        }
    )
    result = run("--ds-world-size", "2")
    result.assert_outcomes(passed=1)


def test_a_tensor_made_without_a_device_fails_the_catalogue_test(pytester: pytest.Pytester, run: RunPytest) -> None:
    """The check names the call and its line; torch's own factories (``nn.Linear``'s) and a device said on purpose
    pass; outside the catalogue's directory nothing is checked."""
    catalogue_copy(pytester)
    body = """
        def test_made_here(ds_device):
            import torch

            torch.nn.Linear(4, 4)
            torch.zeros(2, device="cpu")
            torch.zeros(2, device=ds_device)
            torch.ones(2)
        """
    elsewhere = "def test_made_here():\n    import torch\n\n    torch.ones(2)\n"
    pytester.makepyfile(**{"repros/test_made_here": body, "test_elsewhere": elsewhere})
    pytester.makeconftest("import pytest\n\ndef pytest_collection_modifyitems(items):\n"
                          "    for item in items:\n        item.add_marker(pytest.mark.ds_world)\n")  # fmt: skip
    result = run("--ds-world-size", "1", "-rf")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        ["*MisplacedTensor: torch.ones() without device= at */repros/test_made_here.py:7: on a GPU this tensor would be "
         "on the CPU, not on the rank's device (cpu)*"]
    )  # fmt: skip


def test_the_check_catches_the_module_id_repro_as_it_was(pytester: pytest.Pytester, run: RunPytest) -> None:
    """The module-id repro with the batch helper it had before ``ds_device`` gave wrong verdicts on an H100 (CPU
    batch, CUDA engine): on the CPU its stock run fails with the check's error instead of passing; with today's
    helper it passes, with DeepSpeed's own tensor factories (ZeRO-3's partitioning) unchecked. (Their ``[fixed]``
    variants start no world on a release the bug left.)"""
    repros = catalogue_copy(pytester, "_prerequisites.py")
    today = (ROOT / "repros" / "zero3" / "test_zero3_module_id_clobbered.py").read_text()
    helper = "from pytest_dsrepro.inrank.models import make_batch, tiny_moe"
    assert helper in today
    (repros / "_before_devices.py").write_text(HELPER_BEFORE_DEVICES)
    before = today.replace(helper, "from pytest_dsrepro.inrank.models import tiny_moe\nfrom _before_devices import "
                           "make_batch")  # fmt: skip
    (repros / "test_module_id_before.py").write_text(before)
    (repros / "test_module_id_today.py").write_text(today)
    result = run("--ds-world-size", "1", "-rf", "-p", "no:randomly")
    result.assert_outcomes(passed=1, failed=1, skipped=2)
    result.stdout.fnmatch_lines(["*UNEXPECTED*test_module_id_before.py::*-stock]*"])
    result.stdout.fnmatch_lines(["*MisplacedTensor: torch.randn() without device= at */repros/_before_devices.py:6*"])
