"""Runs in every process of a spawned world: everything that crosses a process boundary, as small frozen dataclasses,
described here once, so that a reader sees every message of a channel in one place and each side dispatches on a
message's class, never on a position. Only builtins, ``core`` data and these classes travel: unpickling a message in
the pytest process must never import torch (``ServerFacts.torch`` is ``str(torch.__version__)``). This module imports
neither torch nor pytest. The channels are described below, before their messages.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from ..core.files import write_atomically
from ..core.outcome import DECLARED, PHASES, ErrorInfo, Measurement, RankResult, Status
from .workdir import result_file

#: After one rank fails, how long the others get to finish (or fail) on their own before they are stopped: the same
#: for a spawned world (``client``) and a launched one (``launched``).
FAILURE_GRACE = 5.0

# ---- the channels ---------------------------------------------------------------------------------------------
#
# Three processes meet here: the pytest process (``worlds.client``), the fork server (``worlds.server``) and the ranks
# it forks (``worlds.rank``). Four channels join them:
#
# - The socket between pytest and the fork server carries the messages below, pickled in ``multiprocessing.connection``
#   framing, dispatched in one loop on each side (``client.fork_server.ForkServer.wait_for``, ``server.serving.serve``):
#
#       server -> pytest   Building(what): an op builds (or a first preload runs), in words for the user, before
#                          Hello, while a Spawn waits or beside the worlds; Hello(facts) once preloaded;
#                          Spawned(world, pids, ...); Exited(world, rank, returncode, at);
#                          Finished(world, rank, at) when a rank of a reusable world is done and waits for a next test;
#                          OpWait(world, at, waiting) when a world's ranks begin or end waiting for an op the server
#                          builds; WorldEnded(world) unasked, when every rank of a world not kept has ended and what
#                          they left is ended too; Reaped(world) once a Reap is done; BuildEnded(what) once a
#                          FinishBuild is done
#       pytest -> server   Spawn(world, job, size, workdir, reuse); DumpStacks(world, ranks); Kill(world, ranks);
#                          Reap(world, keep); FinishBuild()
#
#   The server forks every rank, so it is the only process that signals one: pytest asks it to dump stacks, kill
#   ranks, or reap a world. Rank pids travel in ``Spawned`` for diagnostics only.
# - The report file: a rank's one verdict (``RankReport``) is written atomically into its world's directory by the
#   rank (``write_report``) and read by the pytest process after the rank's ``Exited`` or ``Finished``
#   (``read_report``); the launcher path consumes it in place.
# - The reuse link (a socket pair per rank of a reusable world, ``Spawn.reuse``): a rank whose test passed sends
#   ``RankFinished`` and waits; the server sends it the scope's next test (``NextTest``), or closes the link to end it.
# - The op channel (a socket the server listens on, ``server.op_builds``): a rank's ``jit_load`` sends ``Wanted`` and
#   waits for ``Got``, the op the server built for it, or why there is none.
#
# A rank's job (``RankJob``, pickled inside ``Spawn``) names the test by reference (``TestRef``) and carries its
# arguments pickled apart, with ``RankValue`` placeholders for per-rank fixture values; ranks meet where ``Meeting``
# says.

# ---- what the fork server found -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerFacts:
    """What the fork server found when it preloaded: versions, devices, the comm-op build. Builtins only."""

    pid: int
    torch: str  # "" when torch could not be imported (then ``fatal`` says why)
    deepspeed: str | None = None  # None when DeepSpeed is not importable; ``deepspeed_error`` says why
    deepspeed_error: str | None = None
    deepspeed_path: str | None = None  # the directory the server (and so every rank) imported DeepSpeed from
    cuda_devices: int = 0
    gpus: tuple[str, ...] = ()
    comm_op: str | None = None  # how DeepSpeed's CPU comm op was built or loaded (see ``comm_op.warm_up``)
    comm_op_seconds: float | None = None
    builds_beside: bool = False  # the comm op's first build runs beside the worlds (``comm_op.start``)
    accelerator: str | None = None  # DeepSpeed's accelerator as the ranks get it: "cpu", "cuda"
    accelerator_backend: str | None = None  # its communication backend: "gloo", "ccl", "nccl"
    preloaded: str | None = None  # what the server imported ahead of its ranks (see ``worlds.server.preload``)
    store_pid: int | None = None  # the server's store process, where every world's ranks meet
    fork_hazard: str | None = None  # what would make its forks unsafe (a thread, a CUDA context); None: nothing
    fatal: str | None = None  # the server could not preload and will not run worlds
    stops_run: bool = False  # the fatal is the run's, not this server's (an unusable cache): every world would meet it
    deepspeed_in_ranks: str | None = None  # why each rank imports DeepSpeed after the fork (None: the server did)

    def describe(self) -> str:
        """One line for the terminal: what the worlds of this run ran on."""
        accelerator = f"{self.accelerator} (communication backend {self.accelerator_backend})"
        if self.deepspeed:
            parts = [f"DeepSpeed {self.deepspeed} from {self.deepspeed_path}, accelerator {accelerator}"]
        else:
            parts = [f"DeepSpeed not importable ({self.deepspeed_error})"]
        if self.comm_op:
            parts.append(f"comm op {self.comm_op}")
        if self.preloaded:
            parts.append(f"preloaded {self.preloaded}")
        if self.deepspeed_in_ranks:
            parts.append(f"DeepSpeed imported by each rank after the fork ({self.deepspeed_in_ranks})")
        if self.fork_hazard:
            parts.append(f"WARNING: the fork server forks with {self.fork_hazard}")
        return "; ".join(parts)


#: The fork server's last argument when its first world uses DeepSpeed: what ranks import is found while the comm op
#: builds (``worlds.server.preload.scout``).
SCOUT_ARGUMENT = "--scout"

# ---- server -> pytest -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hello:
    """The server is ready (or, with ``facts.fatal``, is not and exits)."""

    facts: ServerFacts


@dataclass(frozen=True)
class Building:
    """The server is building (or waiting for another process to build) one of DeepSpeed's ops, which takes minutes
    the first time: the comm op before ``Hello`` or beside the worlds (``comm_op.start``), another op beside them when
    a rank asks for it (``op_builds``); ``what`` says so, or how it ended, in words for the user."""

    what: str


@dataclass(frozen=True)
class BuildEnded:
    """Answer to ``FinishBuild``, at once: how the comm-op build that ran beside the worlds ended, or that it goes on
    apart, in words for the user ("" when there was none)."""

    what: str


@dataclass(frozen=True)
class Spawned:
    """The ranks of ``world`` are running; ``pids[rank]`` for diagnostics (pytest never signals them)."""

    world: int
    pids: tuple[int, ...]
    preloaded: str | None = None  # what the server has done ahead of its ranks, once it has (``worlds.server.preload``)
    fork_hazard: str | None = None  # what made forking these ranks unsafe (a thread, a CUDA context); None: nothing
    reused: bool = False  # the ranks ran the previous test of the same ``Spawn.reuse`` and were kept for this one


@dataclass(frozen=True)
class Exited:
    """A rank ended; ``returncode`` as ``subprocess`` writes it (negative: killed by that signal). ``at``: when the
    server reaped it, on ``time.monotonic()``'s clock (one clock for every process of the machine)."""

    world: int
    rank: int
    returncode: int
    at: float | None = None


@dataclass(frozen=True)
class Finished:
    """A rank of a reusable world (``Spawn.reuse``) wrote its report after a clean test (its process group
    destroyed, DeepSpeed's module state and the environment as they were when it was forked) and waits for the next
    test, alive: for its world it counts as a clean exit. ``at`` as in ``Exited``."""

    world: int
    rank: int
    at: float


@dataclass(frozen=True)
class Reaped:
    """Answer to ``Reap``: every process of ``world`` is dead (each rank told by ``Exited`` first) and its directory
    and ``/dev/shm`` buffers are gone."""

    world: int


@dataclass(frozen=True)
class WorldEnded:
    """Every rank of ``world`` (a world not kept between tests: ``Spawn.reuse`` None) has ended, each told by
    ``Exited`` (it exited, or was killed as pytest asked), and the server has already ended what they left (the work
    of a ``Reap``, but for the directory): sent unasked, right after the last ``Exited``, so that pytest need not
    wait for ``Reaped``. pytest then removes the directory itself and still sends ``Reap``, which finds it gone and
    is answered by ``Reaped`` all the same."""

    world: int


@dataclass(frozen=True)
class OpWait:
    """A rank of ``world`` began (``waiting``) waiting for an op that the server builds for it (``server.op_builds``),
    or the last of its ranks that waited got it (not ``waiting``), at ``at`` (``time.monotonic()``): the world's
    clock stops meanwhile, since the build is not its test's time."""

    world: int
    at: float
    waiting: bool


ServerMessage = Hello | Building | Spawned | Exited | Finished | WorldEnded | Reaped | BuildEnded | OpWait
SERVER_MESSAGES = (Hello, Building, Spawned, Exited, Finished, WorldEnded, Reaped, BuildEnded, OpWait)


# ---- the op channel: a rank and the fork server's op builds ---------------------------------------------------


@dataclass(frozen=True)
class Wanted:
    """A rank asks the fork server for one of DeepSpeed's ops: the builder's class (where DeepSpeed defines it), and
    who asks (a rank, or a process it forked), whose world's clock stops while it waits."""

    module: str
    qualname: str
    name: str
    pid: int


@dataclass(frozen=True)
class Got:
    """The server's answer: the op's built library, or why there is none (in words for the test's failure)."""

    library: str | None
    error: str = ""


# ---- pytest -> server -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Spawn:
    """Start a world: ``size`` ranks that each run ``job`` (a pickled ``RankJob``), meeting on the server's store.

    ``reuse``: the test declared reuse (``ds_world(reuse=True)``) and this is its scope; the ranks kept after the
    previous test of the same scope and size run it, with a fresh process group, instead of new ones (``Spawned``
    says which), and after a clean test they wait for the next (``Finished``, then ``Reap(keep=True)``)."""

    world: int
    job: bytes
    size: int
    workdir: str
    reuse: str | None = None


@dataclass(frozen=True)
class DumpStacks:
    """Make these live ranks of ``world`` write every thread's Python stack to their stack files."""

    world: int
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class Kill:
    """SIGKILL these live ranks of ``world``; each is then reported by ``Exited``."""

    world: int
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class Reap:
    """pytest has read the world's directory (or was interrupted): kill whatever of the world is left (ranks and the
    processes they started), report the ranks killed with ``Exited``, discard its directory, say ``Reaped``.

    ``keep``: every rank of a reusable world ``Finished`` cleanly: keep them for the next test of its scope (only
    the directory goes). The server keeps one such world at most, and ends it when another world starts."""

    world: int
    keep: bool = False


@dataclass(frozen=True)
class FinishBuild:
    """The run's tests are over, and it was not interrupted: let the op builds that run beside the worlds go on after
    the server, so that later runs load the ops (``op_builds.OpBuilds.leave``), and say ``BuildEnded``."""


ClientMessage = Spawn | DumpStacks | Kill | Reap | FinishBuild
CLIENT_MESSAGES = (Spawn, DumpStacks, Kill, Reap, FinishBuild)

# ---- the job every rank of a world runs -----------------------------------------------------------------------


def _placeholder_used(self: RankValue, *args: object) -> NoReturn:
    fixture = f"ds_{self.name}"
    raise TypeError(
        f"{fixture} is a placeholder outside the ranks: fixtures run once, in the pytest process, before the world "
        f"exists, and only the test body gets each rank's value. Make the fixture a rank fixture (`from "
        f"pytest_dsrepro import rank_fixture`, `@rank_fixture` instead of `@pytest.fixture`): it then runs in every "
        f"rank with the real {fixture}, and tears down there"
    )


@dataclass(frozen=True, eq=False)
class RankValue:
    """Placeholder sent in place of a fixture value that differs per rank (``ds_rank``, ``ds_world_size``,
    ``ds_device``).

    ``name`` is ``"rank"``, ``"world_size"`` or ``"device"``. Any use as a number or a string (in a fixture, where it
    is not one yet) raises, saying how to write it, instead of computing with the placeholder.
    """

    name: str

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RankValue):
            _placeholder_used(self)
        return self.name == other.name

    def __hash__(self) -> int:
        return hash(self.name)

    __str__ = __format__ = __bool__ = __index__ = __int__ = __float__ = __lt__ = __le__ = __gt__ = __ge__ = (
        _placeholder_used
    )
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __floordiv__ = __mod__ = (
        _placeholder_used
    )


@dataclass(frozen=True)
class TestRef:
    """Where to find the test function, by module file and qualified name (never by pickling the function)."""

    __test__ = False  # not a test class, whatever pytest's collection patterns say

    module_name: str
    module_file: str
    qualname: str  # "test_x" or "TestClass.test_x"
    sys_path: tuple[str, ...]
    cwd: str
    rewrite_asserts: bool = True  # as pytest does (``--assert=plain`` turns it off)


@dataclass(frozen=True)
class EnvironChanges:
    """How the pytest process's environment differs from the one the fork server started with: what fixtures did
    (``monkeypatch.setenv``/``delenv``). Every rank applies it before anything else, so ranks see what the test sees.
    """

    set: tuple[tuple[str, str], ...] = ()
    unset: tuple[str, ...] = ()

    @classmethod
    def between(cls, before: Mapping[str, str], after: Mapping[str, str]) -> EnvironChanges:
        changed = tuple(sorted((k, v) for k, v in after.items() if before.get(k) != v))
        return cls(changed, tuple(sorted(k for k in before if k not in after)))

    def apply(self, environ: MutableMapping[str, str]) -> None:
        environ.update(self.set)
        for name in self.unset:
            environ.pop(name, None)


@dataclass(frozen=True)
class RankJob:
    """What every rank of one world runs. ``payload`` is pickled apart so that it is unpickled only after the test's
    module is imported (parametrize values and fixes may be defined in it)."""

    test: TestRef
    payload: bytes  # pickle of (kwargs, fixes, setup): setup, the rank fixtures the body does not name
    backend: str
    timeout: float
    environ: EnvironChanges = EnvironChanges()  # filled in by the client, which knows the server's environment
    deepspeed: bool = False  # the test uses DeepSpeed: bind its comm layer to the world before the body
    process_group: bool = True  # each rank joins the world's default process group before the body
    launcher_env: bool = True  # each rank gets torchrun's variables (RANK, WORLD_SIZE, MASTER_PORT, ...)
    warm: bool = (
        False  # the test uses DeepSpeed (bound or not): the server warms up for it first (``worlds.server.preload``)
    )


# ---- what a rank reports --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankReport:
    """How one rank's body ended, as the rank itself saw it: the one report both the spawned and launcher paths read.

    What only an observer knows (exit code, output, stacks, a forced stop) is added by the reader, in ``result``.
    """

    status: Status
    error: ErrorInfo | None = None
    detail: str = ""  # the skip or xfail reason
    at: float | None = None  # when the body (or the world's setup) ended, on time.monotonic()'s clock
    where: tuple[str, int] | None = None  # file and line of the body's pytest.skip()/xfail() call
    returned: str = ""  # the type of what the body returned, when it was not None
    fix: str = ""  # the fix that raised while it was being applied (the body never ran)
    measurements: tuple[Measurement, ...] = ()  # what the body timed (``inrank.perf``)
    marks: tuple[float, ...] = ()  # when it started, connected, loaded the test, started, ended its body (``PHASES``)
    not_kept: str = ""  # what the test left that a kept rank cannot put back: the rank exits (``rank.leftovers``)

    def goes_on(self, backend: str) -> bool:
        """May a rank of a reusable world run the next test of its scope after this ending? Only once the world's
        setup and the test's loading went through and the body ended (its ``marks`` are whole); then after a pass,
        and in a gloo world after a failure or a declared skip or xfail too, as DeepSpeed's ``reuse_dist_env`` pool
        and torch's ``MultiProcContinuousTest`` go on: each test gets a new gloo group, and dropping the old one is
        local (a collective the failed test left unmatched does not hold it). Not an NCCL rank after a failure: it
        keeps its communicator, where the failure may have left a collective queued."""
        if len(self.marks) != len(PHASES) - 1:
            return False
        return self.status is Status.PASSED or (backend == "gloo" and self.status in (Status.FAILED, *DECLARED))

    def result(self, rank: int, output: str = "", started: float | None = None) -> RankResult:
        """``started``: when the world started, on the same clock; the result's ``at`` is counted from it."""
        at = None if self.at is None or started is None else max(0.0, self.at - started)
        return RankResult(
            rank, self.status, error=self.error, detail=self.detail, output=output, at=at, where=self.where,
            returned=self.returned, fix=self.fix, measurements=self.measurements,
        )  # fmt: skip


def write_report(workdir: Path, rank: int, report: RankReport) -> None:
    """Whole or not at all, so that the pytest process never reads half a report (not synced to disk: read at once,
    in this boot, then discarded with the world)."""
    write_atomically(result_file(workdir, rank), pickle.dumps(report), durable=False)


def read_report(workdir: Path, rank: int) -> RankReport | None:
    """The rank's report; None when it wrote none (it died, or exited before its body completed)."""
    path = result_file(workdir, rank)
    if not path.exists():
        return None
    report = pickle.loads(path.read_bytes())
    if not isinstance(report, RankReport):
        raise TypeError(f"{path} holds a {type(report).__name__}, not a RankReport")
    return report


# ---- the reuse link: the fork server and a kept rank --------------------------------------------------------


@dataclass(frozen=True)
class Meeting:
    """Where a world's ranks meet: the fork server's store (its loopback port) and the world's id there."""

    port: int
    world: int


@dataclass(frozen=True)
class RankFinished:
    """rank -> server: the test's body ended so that the rank goes on (``RankReport.goes_on``), the rank put back
    what it had when it was forked (``rank.reuse_reset``) and waits for the next test of its scope; ``at`` on
    ``time.monotonic()``'s clock. The server tells pytest ``Finished``.
    """

    at: float


@dataclass(frozen=True)
class NextTest:
    """server -> rank: the next test of its scope for a kept rank (``code``: the test module's, marshalled)."""

    job: RankJob
    workdir: str
    meeting: Meeting
    code: bytes | None
