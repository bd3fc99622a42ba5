"""Runs in a rank, spawned or launched (then in the pytest process of each rank): the test body, with its fixes
applied, DeepSpeed's comm layer bound and its rank fixtures set up; how it ended, as one ``RankReport``.

It imports torch and DeepSpeed only inside functions. The test module is imported here, after the fork
(``testmodule``), with the code the fork server compiled for every rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from types import CodeType, TracebackType
from typing import Any

from ...core.outcome import ErrorInfo, Status
from ...inrank import context, fixtures
from ...inrank.context import RankContext
from ..protocol import RankReport, RankValue, TestRef
from . import testmodule

Fix = Callable[[Any], None]  # called with a pytest.MonkeyPatch


def resolve_test(ref: TestRef, code: CodeType | None = None) -> Callable[..., Any]:
    """The test function in its freshly imported module; ``code``: the module's code, compiled before the fork."""
    sys.path[:] = list(ref.sys_path)
    os.chdir(ref.cwd)
    obj: Any = testmodule.load(ref.module_name, ref.module_file, rewrite=ref.rewrite_asserts, code=code)
    parts = ref.qualname.split(".")
    for i, part in enumerate(parts):
        obj = getattr(obj, part)
        if isinstance(obj, type) and i < len(parts) - 1:
            obj = obj()  # pytest instantiates test classes per test; so do we
    return obj  # type: ignore[no-any-return]


def _arguments(
    kwargs: dict[str, Any], ctx: RankContext, stack: contextlib.ExitStack, setup: Sequence[fixtures.RankFixture]
) -> dict[str, Any]:
    """The body's arguments in this rank: per-rank values in place of their placeholders, rank fixtures set up."""
    values = {"rank": ctx.rank, "world_size": ctx.world_size, "device": ctx.device}

    def substitute(v: Any) -> Any:
        return values[v.name] if isinstance(v, RankValue) else v

    return fixtures.arguments(kwargs, stack, substitute, setup)


def failed_report(exc: BaseException, heading: str, traceback_text: str) -> RankReport:
    error = ErrorInfo.from_exception(exc, heading + traceback_text)
    return RankReport(Status.FAILED, error=error, at=time.monotonic())


def called_at(tb: TracebackType | None) -> tuple[str, int] | None:
    """Where a ``pytest.skip()``/``xfail()`` was called: the innermost frame pytest would show (not hidden by
    ``__tracebackhide__``, as pytest's own ``skip()`` is), so the pytest process reports the body's line."""
    where = None
    while tb is not None:
        frame = tb.tb_frame
        if not frame.f_locals.get("__tracebackhide__", frame.f_globals.get("__tracebackhide__", False)):
            where = (frame.f_code.co_filename, tb.tb_lineno)
        tb = tb.tb_next
    return where


def bind_deepspeed(backend: str) -> None:
    """Bind DeepSpeed's comm layer to the world's default process group, as ``deepspeed.initialize`` does on its first
    call, so that ``deepspeed.zero.Init``, ``deepspeed.comm`` and config validation see the real world before any
    engine exists. DeepSpeed takes the group that is already there (its "user initialized torch.dist" path, the same
    in 0.14 to 0.19); on the CPU accelerator it also maps its shm allreduce buffer (~0.09 s a world, hence only for
    tests that use DeepSpeed)."""
    import deepspeed

    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)


def _fix_name(fix: Fix) -> str:
    return str(getattr(fix, "__qualname__", None) or repr(fix))


def _monkeypatches(values: Iterable[Any]) -> Iterator[Any]:
    """The ``pytest.MonkeyPatch`` objects among a body's arguments and its rank fixtures' arguments."""
    import pytest

    for value in values:
        if isinstance(value, pytest.MonkeyPatch):
            yield value
        elif isinstance(value, fixtures.RankFixture):
            yield from _monkeypatches(value.kwargs.values())


def run_body(
    fn: Callable[..., Any],
    kwargs: dict[str, Any],
    fixes: Sequence[Fix],
    ctx: RankContext,
    *,
    deepspeed: bool = False,
    setup: Sequence[fixtures.RankFixture] = (),
    mark: Callable[[], None] = lambda: None,
    undo_patches: bool = False,
) -> RankReport:
    """Apply the fixes (through a MonkeyPatch, undone afterwards), bind DeepSpeed's comm layer when the test uses
    DeepSpeed (after the fixes: a fix may patch that layer), set up rank fixtures (``setup`` first: those the body
    does not name, autouse ones among them), and run the body; report how it ended (a rank fixture's failing
    teardown fails the rank; a fix that raises is named: the body never ran) and what the body timed. ``mark`` is
    called as the body starts. ``undo_patches``: a spawned rank undoes the ``monkeypatch`` the body and its rank
    fixtures got (a copy of pytest's, which undoes only its own) once the rank fixtures are torn down, before the
    fixes are, as pytest would."""
    import pytest

    applying = ""
    try:
        with context.running(ctx), pytest.MonkeyPatch.context() as monkeypatch, contextlib.ExitStack() as stack:
            for fix in fixes:
                applying = _fix_name(fix)
                fix(monkeypatch)
            applying = ""
            for patch in _monkeypatches([*kwargs.values(), *setup]) if undo_patches else ():
                stack.callback(patch.undo)
            if deepspeed:
                bind_deepspeed(ctx.backend)
            arguments = _arguments(kwargs, ctx, stack, setup)
            mark()
            result = fn(**arguments)  # rank fixtures are torn down on leaving, fixes still on
    except (pytest.skip.Exception, pytest.xfail.Exception) as exc:
        status = Status.XFAILED if isinstance(exc, pytest.xfail.Exception) else Status.SKIPPED
        return RankReport(status, detail=str(exc.msg), at=time.monotonic(), where=called_at(exc.__traceback__))
    except BaseException as exc:  # noqa: BLE001 - every way a body can fail is reported
        tb = exc.__traceback__.tb_next if exc.__traceback__ else None  # not this frame
        heading = f"the fix {applying} raised while it was being applied; the body never ran:\n" if applying else ""
        report = failed_report(exc, heading, "".join(traceback.format_exception(type(exc), exc, tb)))
        return dataclasses.replace(report, fix=applying, measurements=context.measurements())
    returned = "" if result is None else repr(type(result))
    return RankReport(Status.PASSED, at=time.monotonic(), returned=returned, measurements=context.measurements())
