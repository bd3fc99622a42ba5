"""Runs in a rank, and in the fork server just before it forks one (``compile_source``, once for every rank of a
world): the test module as a rank imports it, the file pytest collected, its asserts rewritten as pytest does. The
fork server never imports tests, and pytest rewrites asserts only in modules its own import hook loads (which needs
the pytest process's ``Config``), so a rank compiles the file with pytest's rewriter itself: a plain ``assert`` then
fails with its values, as in pytest. pytest has no public API for this, so this is the one module that imports
``_pytest`` (an ``ignore_imports`` entry of the import contract names it).
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.machinery
import importlib.util
import sys
from types import CodeType, ModuleType

from .reuse_reset import remember


def compile_source(path: str, source: bytes, *, rewrite: bool) -> CodeType:
    """The module's code from its source, asserts rewritten as pytest rewrites them when ``rewrite``."""
    if not rewrite:
        return compile(source, path, "exec", dont_inherit=True)
    from _pytest.assertion.rewrite import rewrite_asserts

    tree = ast.parse(source, filename=path)
    rewrite_asserts(tree, source, path)
    return compile(tree, path, "exec", dont_inherit=True)


class _RewritingLoader(importlib.machinery.SourceFileLoader):
    """A source loader that always compiles from source, with pytest's assertion rewriting (never a cached pyc)."""

    def get_code(self, fullname: str) -> CodeType:
        path = self.get_filename(fullname)
        return compile_source(path, self.get_data(path), rewrite=True)


class _CompiledLoader(importlib.machinery.SourceFileLoader):
    """A loader whose module code was compiled before the fork (by the fork server, once for every rank)."""

    def __init__(self, fullname: str, path: str, code: CodeType) -> None:
        super().__init__(fullname, path)
        self.code = code

    def get_code(self, fullname: str) -> CodeType:
        return self.code


def load(name: str, path: str, *, rewrite: bool, code: CodeType | None = None) -> ModuleType:
    """Import the file at ``path`` as module ``name`` (its package first, so relative imports work); ``code``: the
    file's code already compiled as ``rewrite`` says (``compile_source``), else it is compiled here.

    Loaded from the file, never by name from ``sys.path``: under pytest's importlib mode the name is not importable,
    and a same-named module elsewhere on the path must not stand in for the test.
    """
    if name in sys.modules:
        return sys.modules[name]
    package = name.rpartition(".")[0]
    if package:
        with contextlib.suppress(ImportError):  # a rootdir-relative name whose package is not importable
            importlib.import_module(package)
    loader: importlib.machinery.SourceFileLoader
    if code is not None:
        loader = _CompiledLoader(name, path, code)
    else:
        loader = _RewritingLoader(name, path) if rewrite else importlib.machinery.SourceFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load the test module {name} from {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    remember(module)  # its containers as imported: a kept rank puts them back after each test
    return module
