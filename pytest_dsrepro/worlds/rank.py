"""Everything that happens inside one rank: rendezvous, the default process group, the test body.

This module runs in forked rank processes (and, under an external launcher, in the pytest process of each rank).
It imports torch only inside functions. What a rank receives and reports are ``protocol`` types: a ``RankJob`` in,
one ``RankReport`` out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import pickle
import socket
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import CodeType, TracebackType
from typing import Any, NoReturn

from ..core.outcome import ErrorInfo, Status
from ..inrank import context, fixtures
from ..inrank.context import RankContext
from . import nccl, testmodule
from .protocol import RankJob, RankReport, RankValue, TestRef
from .workdir import LOOPBACK

Fix = Callable[[Any], None]  # called with a pytest.MonkeyPatch


@dataclass(frozen=True)
class Meeting:
    """Where a world's ranks meet: the fork server's store (its loopback port) and the world's id there."""

    port: int
    world: int


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


def _timeout(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def serve_store(listener: socket.socket) -> NoReturn:
    """Host a TCPStore on ``listener`` until this process is killed (the fork server's store process).

    Every world of one fork server meets there under its own key prefix (``world_prefix``). The socket is bound
    before this process starts, to a loopback port the OS picked: ranks know the port at once and may connect before
    the store accepts (the kernel queues them); no port scanning, no bind-and-close race, nothing listening beyond
    this machine.
    """
    import torch.distributed as dist

    port = listener.getsockname()[1]
    store = dist.TCPStore(  # type: ignore[attr-defined]  # noqa: F841 - kept alive until the process is killed
        LOOPBACK, port, None, True, wait_for_workers=False, master_listen_fd=listener.detach()
    )
    while True:
        time.sleep(3600)


def world_prefix(world: int) -> str:
    return f"dsrepro/world-{world}/"


def rendezvous(port: int, world: int, timeout: float) -> Any:
    """The world's own view of the fork server's store: its keys under the world's prefix."""
    import torch.distributed as dist

    client = dist.TCPStore(  # type: ignore[attr-defined]
        LOOPBACK, port, None, False, timeout=_timeout(timeout), wait_for_workers=False
    )
    return dist.PrefixStore(world_prefix(world), client)  # type: ignore[attr-defined]


def set_rank_environment(rank: int, world_size: int, port: int) -> None:
    """The variables torchrun and DeepSpeed's own launcher set, so DeepSpeed code reading them behaves as launched.

    ``LOCAL_SIZE`` is what DeepSpeed's launcher exports; its CPU shared-memory allreduce keys on it.
    """
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        LOCAL_SIZE=str(world_size),
        MASTER_ADDR=LOOPBACK,
        MASTER_PORT=str(port),
    )


#: Store key under which rank 0 of a world without the plugin's process group publishes its own master port.
MASTER_PORT_KEY = "dsrepro/master_port"


def own_master_port(store: Any, rank: int, timeout: float) -> tuple[int, Any]:
    """A ``MASTER_PORT`` for a world whose body makes its own process group (``init_process_group()`` reads it):
    rank 0 hosts a TCPStore on a loopback port the OS picks and publishes it on the world's store; every rank reads
    it. The store is multi-tenant, so the ``env://`` rendezvous of rank 0's body serves on it instead of binding
    the port again (no free port guessed, no bind-and-close race). Returns the port and the store, which must stay
    alive as long as the rank."""
    import torch.distributed as dist

    server = None
    if rank == 0:
        server = dist.TCPStore(  # type: ignore[attr-defined]
            LOOPBACK, 0, None, True, timeout=_timeout(timeout), wait_for_workers=False, multi_tenant=True
        )
        store.set(MASTER_PORT_KEY, str(server.port))
    store.wait([MASTER_PORT_KEY], _timeout(timeout))
    return int(store.get(MASTER_PORT_KEY)), server


def init_default_group(backend: str, store: Any, rank: int, world_size: int, timeout: float) -> None:
    import torch
    import torch.distributed as dist

    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local_rank)
        kwargs["device_id"] = torch.device("cuda", local_rank)
        timeout = nccl.process_group_timeout(timeout)  # the harness ends a hang first, and dumps what NCCL saw
        nccl.serve_dump_request(rank)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=_timeout(timeout), **kwargs)


#: Store keys of the agreement below: a counter, and the key the last rank to arrive sets.
CONNECTED_COUNT = "dsrepro/connected"
ALL_CONNECTED = "dsrepro/all_connected"


def agree_connected(store: Any, world_size: int, timeout: float) -> None:
    """Return only once every rank of the world has its default process group: no rank may exit (closing its
    connections) while a slower one is still connecting. Without it a body that runs no collective failed ~0.3% of
    its worlds with gloo's "connectFullMesh failed ... Connection closed by peer" in the slow rank.

    On the world's own store (not the process group's), so it adds no collective to the test: one ``add`` per rank,
    the last one to arrive sets the key every rank waits for.
    """
    if store.add(CONNECTED_COUNT, 1) == world_size:
        store.set(ALL_CONNECTED, "1")
    store.wait([ALL_CONNECTED], _timeout(timeout))


def _arguments(
    kwargs: dict[str, Any], ctx: RankContext, stack: contextlib.ExitStack, setup: Sequence[fixtures.RankFixture]
) -> dict[str, Any]:
    """The body's arguments in this rank: per-rank values in place of their placeholders, rank fixtures set up."""
    values = {"rank": ctx.rank, "world_size": ctx.world_size, "device": ctx.device}

    def substitute(v: Any) -> Any:
        return values[v.name] if isinstance(v, RankValue) else v

    return fixtures.arguments(kwargs, stack, substitute, setup)


def _failed(exc: BaseException, heading: str, traceback_text: str) -> RankReport:
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


def run_body(
    fn: Callable[..., Any],
    kwargs: dict[str, Any],
    fixes: Sequence[Fix],
    ctx: RankContext,
    *,
    deepspeed: bool = False,
    setup: Sequence[fixtures.RankFixture] = (),
    mark: Callable[[], None] = lambda: None,
) -> RankReport:
    """Apply the fixes (through a MonkeyPatch, undone afterwards), bind DeepSpeed's comm layer when the test uses
    DeepSpeed (after the fixes: a fix may patch that layer), set up rank fixtures (``setup`` first: those the body
    does not name, autouse ones among them), and run the body; report how it ended (a rank fixture's failing
    teardown fails the rank; a fix that raises is named: the body never ran) and what the body timed. ``mark`` is
    called as the body starts."""
    import pytest

    applying = ""
    try:
        with context.running(ctx), pytest.MonkeyPatch.context() as monkeypatch, contextlib.ExitStack() as stack:
            for fix in fixes:
                applying = _fix_name(fix)
                fix(monkeypatch)
            applying = ""
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
        failed = _failed(exc, heading, "".join(traceback.format_exception(type(exc), exc, tb)))
        return dataclasses.replace(failed, fix=applying, measurements=context.measurements())
    returned = "" if result is None else repr(type(result))
    return RankReport(Status.PASSED, at=time.monotonic(), returned=returned, measurements=context.measurements())


def run_rank(job: RankJob, rank: int, world_size: int, meeting: Meeting, code: CodeType | None = None) -> RankReport:
    """The whole life of a spawned rank, except process plumbing (see ``server``); ``code``: the test module's code,
    compiled by the fork server for every rank of the world (None: compiled here). Its report's ``marks`` say when
    it got through each phase of the world (``core.outcome.PHASES``)."""
    marks = [time.monotonic()]

    def mark() -> None:
        marks.append(time.monotonic())

    job.environ.apply(os.environ)
    master = None  # a world without the plugin's process group: (port, rank 0's own store), alive with the rank
    try:
        store = rendezvous(meeting.port, meeting.world, job.timeout)
        if job.launcher_env:
            if not job.process_group:  # the body makes the group, on a MASTER_PORT nobody else serves
                master = own_master_port(store, rank, job.timeout)
            set_rank_environment(rank, world_size, master[0] if master else meeting.port)
        if job.process_group:
            init_default_group(job.backend, store, rank, world_size, job.timeout)
        agree_connected(store, world_size, job.timeout)
    except BaseException as exc:  # noqa: BLE001
        return _failed(exc, "world setup failed:\n", traceback.format_exc())
    mark()
    ctx = RankContext(rank=rank, world_size=world_size, local_rank=rank, backend=job.backend)
    try:
        fn = resolve_test(job.test, code)
        kwargs, fixes, setup = pickle.loads(job.payload)
    except BaseException as exc:  # noqa: BLE001
        return _failed(exc, "loading the test failed:\n", traceback.format_exc())
    mark()
    report = run_body(fn, kwargs, fixes, ctx, deepspeed=job.deepspeed, setup=setup, mark=mark)
    import torch.distributed as dist

    if dist.is_initialized() and report.status is Status.PASSED:
        # Only a clean rank tears down collectively; a failed one must not wait on peers that may be gone.
        dist.destroy_process_group()
    return dataclasses.replace(report, marks=(*marks, report.at or time.monotonic()))
