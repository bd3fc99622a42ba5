"""The distributions as the ecosystem expects them: built from a copy of this tree (no download: no build
isolation), checked by ``twine check --strict``, PEP 639 license metadata, and an sdist holding what its own tests and
docs need."""

from __future__ import annotations

import email.parser
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from conftest import LOCAL, ROOT

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10 reads TOML with tomli, a dependency there
    import tomli as tomllib


@pytest.fixture
def dists(plugin_dists: tuple[Path, Path]) -> tuple[Path, Path]:
    return plugin_dists


def test_twine_check_strict(dists: tuple[Path, Path]) -> None:
    pytest.importorskip("twine")
    proc = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", *map(str, dists)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("PASSED") == 2


def test_wheel_metadata(dists: tuple[Path, Path]) -> None:
    _, wheel = dists
    with zipfile.ZipFile(wheel) as z:
        meta = email.parser.Parser().parsestr(z.read("pytest_dsrepro-0.1.0.dist-info/METADATA").decode())
        names = z.namelist()
    assert meta["Metadata-Version"] == "2.4"
    assert meta["License-Expression"] == "Apache-2.0"  # PEP 639, not the deprecated table
    assert meta.get_all("License-File") == ["LICENSE"]
    assert "pytest_dsrepro-0.1.0.dist-info/licenses/LICENSE" in names
    assert not [c for c in meta.get_all("Classifier") if c.startswith("License ::")]  # PEP 639 forbids both
    classifiers = meta.get_all("Classifier")
    for wanted in ("Framework :: Pytest", "Operating System :: POSIX :: Linux", "Programming Language :: Python :: 3.11",
                   "Typing :: Typed"):  # fmt: skip
        assert wanted in classifiers
    urls = dict(u.split(", ", 1) for u in meta.get_all("Project-URL"))
    assert urls["Homepage"] == "https://pypi.org/project/pytest-dsrepro/"
    assert "pytest_dsrepro/py.typed" in names
    assert "pytest_dsrepro/tools/templates/repro.py.tmpl" in names
    with zipfile.ZipFile(wheel) as z:
        entry_points = z.read("pytest_dsrepro-0.1.0.dist-info/entry_points.txt").decode()
    assert "dsrepro = pytest_dsrepro.plugin" in entry_points
    assert "dsrepro = pytest_dsrepro.tools.cli:main" in entry_points


def test_wheel_holds_every_module_and_the_catalogue(dists: tuple[Path, Path]) -> None:
    """The packages are listed in pyproject.toml (the catalogue is mapped from repros/): a module or subpackage
    added without being listed is caught here, and so is a repro the wheel would not carry."""
    _, wheel = dists
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    code = {p.relative_to(ROOT).as_posix() for p in (ROOT / "pytest_dsrepro").rglob("*.py")}
    repros = {f"pytest_dsrepro/catalogue/{p.relative_to(ROOT / 'repros').as_posix()}"
              for p in (ROOT / "repros").rglob("*.py")}  # fmt: skip
    assert "pytest_dsrepro/catalogue/conftest.py" in repros
    assert "pytest_dsrepro/catalogue/zero3/test_zero3_module_id_clobbered.py" in repros  # the subsystems' folders too
    assert sorted(code - names) == []
    assert sorted(repros - names) == []
    assert not [n for n in names if n.startswith("repros/")]  # installed inside the package, never top-level


def test_every_folder_of_the_catalogue_is_a_listed_package() -> None:
    """Each folder of repros/ that holds a module is listed in pyproject.toml's packages (setuptools would leave a
    folder it is not told of out of the wheel, and only the build above would say so)."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {p.parent.relative_to(ROOT / "repros") for p in (ROOT / "repros").rglob("*.py")}
    wanted = {".".join(("pytest_dsrepro.catalogue", *folder.parts)) for folder in folders}
    assert sorted(wanted - listed) == [], "add these to [tool.setuptools] packages in pyproject.toml"


def test_sdist_holds_what_its_tests_and_docs_need(dists: tuple[Path, Path]) -> None:
    sdist, _ = dists
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    for wanted in ("LICENSE", "README.md", "tox.ini", "constraints.txt", "repros/conftest.py", "tests/conftest.py",
                   "docs/design.md", "docs/matrix.md", "repros/zero3/test_zero3_backward_without_optimizer.py",
                   "benchmarks/world_overhead.py", "pytest_dsrepro/tools/templates/repro.py.tmpl"):  # fmt: skip
        assert wanted in names, wanted
    tracked = {p.relative_to(ROOT).as_posix() for d in ("tests", "docs") for p in (ROOT / d).glob("*.*")}
    tracked |= {p.relative_to(ROOT).as_posix() for p in (ROOT / "repros").rglob("*.*")}
    assert tracked <= names | {t for t in tracked if "__pycache__" in t or t.endswith(".pyc")}
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]


def test_license_is_the_apache_license() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License\n                           Version 2.0, January 2004")
    assert "END OF TERMS AND CONDITIONS" in text


@pytest.mark.parametrize("frontend", ["pip", "uv"])
def test_an_editable_install_imports_the_catalogue(tmp_path: Path, frontend: str) -> None:
    """Issue 49, item 6: ``pip install -e .`` and ``uv pip install -e .`` of a checkout, in a new environment with
    no network (no index, no build isolation: this environment's setuptools lent to it, nothing else of it), import
    ``pytest_dsrepro.catalogue`` from the checkout's ``repros/``, as docs/writing-repros.md tells users to."""
    from uv import find_uv_bin

    tree = tmp_path / "pytest-dsrepro"
    shutil.copytree(ROOT, tree, ignore=LOCAL)
    venv = tmp_path / "venv"
    uv = find_uv_bin()
    make = [sys.executable, "-m", "venv", str(venv)] if frontend == "pip" else [uv, "venv", "-q", str(venv)]
    subprocess.run(make, check=True, capture_output=True, timeout=120)
    python = venv / "bin" / "python"
    if frontend == "pip":  # ensurepip brings pip, and on Python < 3.12 a setuptools too old for PEP 639 metadata
        subprocess.run([python, "-m", "pip", "uninstall", "-q", "-y", "setuptools"], check=True, capture_output=True)
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())  # fmt: skip
    lent = tmp_path / "setuptools-lent"
    lent.mkdir()
    # Found, not imported: setuptools' distutils hack refuses to load where a test before this one imported distutils.
    spec = importlib.util.find_spec("setuptools")
    assert spec is not None
    assert spec.origin is not None
    here = Path(spec.origin).parent.parent
    for name in ("setuptools", "_distutils_hack", f"setuptools-{importlib.metadata.version('setuptools')}.dist-info"):
        (lent / name).symlink_to(here / name)
    (site / "setuptools-lent.pth").write_text(f"{lent}\n")
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull, "UV_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    install = (
        [python, "-m", "pip", "install", "-q", "--no-index", "--no-build-isolation", "--no-deps", "-e", str(tree)]
        if frontend == "pip"
        else [uv, "pip", "install", "-q", "--python", str(python), "--no-build-isolation", "--no-deps", "-e", str(tree)]
    )
    proc = subprocess.run(install, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    where = ("import importlib.util, pytest_dsrepro, pytest_dsrepro.catalogue; print(pytest_dsrepro.__file__); "
             "print(importlib.util.find_spec('pytest_dsrepro.catalogue.prerequisites').origin)")  # fmt: skip
    found = subprocess.run([python, "-c", where], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert found.returncode == 0, found.stderr
    assert found.stdout.split() == [
        str(tree / "pytest_dsrepro" / "__init__.py"),
        str(tree / "repros" / "prerequisites.py"),
    ]
