"""What a world's ranks did, and how a user reads it.

Plain data, picklable and free of torch, so that ranks can send it and the pytest process, the version gates and
the reports can all read it without importing anything heavy.
"""

from __future__ import annotations

import enum
import itertools
import math
import signal
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

#: Lines of a rank's own stdout/stderr shown under its failure.
OUTPUT_TAIL_LINES = 25
#: Lines of the start of an output shown when its middle was cut.
OUTPUT_HEAD_LINES = 5
#: How much of a rank's own output is ever read, kept and reported: its first and its last bytes. A rank printing
#: in a loop, or one 10 MB line, costs the pytest process, the results file and the JUnit XML no more than this.
OUTPUT_HEAD_BYTES = 2048
OUTPUT_TAIL_BYTES = 6144
#: The line that stands for the middle of an output that was cut.
CUT_PREFIX = "[... pytest-dsrepro cut "


#: What an error says when its rank only lost a peer: gloo's pair.cc ("Connection closed by peer ... typically caused
#: by a remote worker crashing"), a reset or broken socket, NCCL's abort after another rank failed. Such an error
#: follows another rank's end, so it is told after the ranks that ended on their own.
PEER_LOST = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "remote worker crashing",
    "NCCL communicator was aborted",
    "remote process exited",
)


class Status(enum.Enum):
    PASSED = "passed"
    FAILED = "failed"  # the body raised
    SKIPPED = "skipped"  # the body called pytest.skip()
    XFAILED = "xfailed"  # the body called pytest.xfail()
    CRASHED = "crashed"  # the process died, or exited without saying its body completed
    HUNG = "hung"  # still running when the world's timeout expired
    STOPPED = "stopped"  # healthy, but stopped because another rank failed


#: Endings a body declares itself, as pytest.skip() and pytest.xfail() do: never a failure of the rank.
DECLARED = (Status.SKIPPED, Status.XFAILED)


@dataclass(frozen=True)
class ErrorInfo:
    """An exception raised in a rank, reduced to what can cross a process boundary.

    ``type_names`` is the exception's MRO as ``module.qualname`` strings, so ``raises=`` can be matched without
    importing (or unpickling) the exception's class in the pytest process.
    """

    type_names: tuple[str, ...]
    text: str  # str(exc): what ``match=`` searches, as pytest.raises does
    traceback: str

    @property
    def type_name(self) -> str:
        return self.type_names[0].removeprefix("builtins.")

    @property
    def summary(self) -> str:
        short = self.type_name.rsplit(".", 1)[-1]
        return f"{short}: {self.text}" if self.text else short

    def is_instance_of(self, exc_type: type[BaseException]) -> bool:
        return f"{exc_type.__module__}.{exc_type.__qualname__}" in self.type_names

    @classmethod
    def from_exception(cls, exc: BaseException, traceback: str) -> ErrorInfo:
        names = tuple(f"{c.__module__}.{c.__qualname__}" for c in type(exc).__mro__)
        return cls(type_names=names, text=str(exc), traceback=traceback)


@dataclass(frozen=True)
class Measurement:
    """One timing a body took against a reference timed in the same run, interleaved with it (``inrank.perf``).

    Both times are the least of their repeats (load only ever adds time) and the same in every rank (the ranks agree
    on the slowest), so ``ratio`` is one number for the world; ``limit`` is the ratio at and above which the subject
    counts as the slowdown.
    """

    what: str  # what was timed, in words ("backward of 256 parameter tensors")
    reference: str  # what it was timed against, doing the same work the healthy way ("8 backwards of 32 tensors")
    seconds: float
    reference_seconds: float
    limit: float
    repeats: int
    clock: str = "cpu"  # "cpu": the rank's thread's CPU time; "wall": wall time

    @property
    def ratio(self) -> float:
        return self.seconds / self.reference_seconds if self.reference_seconds > 0 else math.inf

    @property
    def slow(self) -> bool:
        return self.ratio >= self.limit

    @property
    def margin(self) -> float:
        """How many times over the ratio would have to change for the verdict to flip (> 1: the side it is on)."""
        ratio = self.ratio
        if ratio <= 0:
            return math.inf
        return ratio / self.limit if self.slow else self.limit / ratio

    @property
    def clock_name(self) -> str:
        return "CPU time" if self.clock == "cpu" else "wall time"

    @property
    def brief(self) -> str:
        """``timed 7.91x its reference (limit 3x, margin 2.6x)``: for a line that names the test already."""
        return f"timed {self.ratio:.2f}x its reference (limit {self.limit:g}x, margin {self.margin:.1f}x)"

    def describe(self) -> str:
        """``backward of 256 tensors took 7.91x 8 backwards of 32 tensors (limit 3x: slow, margin 2.6x)``."""
        side = "slow" if self.slow else "not slow"
        return (
            f"{self.what} took {self.ratio:.2f}x {self.reference} ({self.seconds * 1e3:.1f} ms against "
            f"{self.reference_seconds * 1e3:.1f} ms of {self.clock_name}, least of {self.repeats}; limit "
            f"{self.limit:g}x: {side}, margin {self.margin:.1f}x)"
        )


@dataclass(frozen=True)
class RankResult:
    rank: int
    status: Status
    error: ErrorInfo | None = None
    detail: str = ""  # skip reason, exit code/signal, or why it was stopped
    output: str = ""  # the rank's captured stdout+stderr (fd level), bounded: its first and last bytes
    stack: str = ""  # Python stacks dumped by faulthandler when it hung, was stopped or crashed
    at: float | None = None  # seconds into the world when it failed or ended on its own (None: not known)
    where: tuple[str, int] | None = None  # file and line of the body's pytest.skip()/xfail() call
    returned: str = ""  # the type the body returned when it was not None, as pytest names it ("<class 'int'>")
    fix: str = ""  # the fix that raised while it was being applied (the body never ran); "": not a fix's failure
    measurements: tuple[Measurement, ...] = ()  # what the body timed (``inrank.perf``), in the order it did

    @property
    def lost_peer(self) -> bool:
        """Its error only says a peer went away: a consequence of another rank's end, not a cause."""
        return (
            self.status is Status.FAILED
            and self.error is not None
            and any(words in self.error.text for words in PEER_LOST)
        )

    @property
    def headline(self) -> str:
        if self.status is Status.FAILED and self.error is not None:
            return self.error.summary
        if self.status in (Status.SKIPPED, Status.XFAILED):
            return f"{self.status.value}: {self.detail}"
        return f"{self.status.value}: {self.detail}" if self.detail else self.status.value


#: Where a world's time goes, in order: forking the ranks (until the last one runs), the rendezvous (every rank's
#: default process group up), importing the test module and its arguments, the setup before the body (fixes, DeepSpeed's
#: comm layer bound, rank fixtures), the body, and the teardown (process group destroyed, the report written, the rank
#: gone or parked). A phase ends when its slowest rank ends it. What a first use costs in the body is the body's time
#: against the same body on warm ranks (``benchmarks/world_overhead.py`` measures both).
PHASES = ("fork", "rendezvous", "imports", "setup", "body", "teardown")


def phases(spawned: float, marks: Sequence[Sequence[float]], ended: float) -> tuple[tuple[str, float], ...]:
    """Seconds per phase (``PHASES``) from when the world was asked for, each rank's marks (started, connected,
    loaded, body started, body ended; ``time.monotonic()``, one clock for the machine) and when its last rank ended.
    """
    ends = [max(rank[i] for rank in marks) for i in range(len(PHASES) - 1)] + [ended]
    starts = [spawned, *ends[:-1]]
    return tuple((name, max(0.0, end - start)) for name, start, end in zip(PHASES, starts, ends, strict=True))


@dataclass(frozen=True)
class WorldOutcome:
    size: int
    backend: str
    ranks: tuple[RankResult, ...]
    duration: float
    phases: tuple[tuple[str, float], ...] = ()  # seconds per phase (``PHASES``) when every rank got through them
    reused: bool = False  # its ranks ran an earlier test of the same reuse scope (``ds_world(reuse=True)``)
    not_kept: str = ""  # why its ranks are not kept for the next test of that scope: what the test left in them

    @property
    def passed(self) -> bool:
        return all(r.status is Status.PASSED for r in self.ranks)

    @property
    def declared(self) -> RankResult | None:
        """The rank whose body declared the test's outcome (``pytest.skip()``, ``pytest.xfail()``), unless another rank
        went wrong: a skip or xfail in any rank is the test's, as in plain pytest."""
        declared = [r for r in self.ranks if r.status in DECLARED]
        if declared and all(r.status is Status.PASSED or r.status in DECLARED for r in self.ranks):
            return declared[0]
        return None

    @property
    def failures(self) -> tuple[RankResult, ...]:
        """The ranks that went wrong, root causes first (``by_cause``)."""
        return tuple(by_cause(r for r in self.ranks if r.status not in (Status.PASSED, *DECLARED, Status.STOPPED)))

    @property
    def errors(self) -> tuple[ErrorInfo, ...]:
        return tuple(r.error for r in self.failures if r.error is not None)

    @property
    def measurements(self) -> tuple[Measurement, ...]:
        """What the body timed, as the ranks agreed on it: the lowest rank's that timed anything."""
        return next((r.measurements for r in sorted(self.ranks, key=lambda r: r.rank) if r.measurements), ())


def by_cause(results: Iterable[RankResult]) -> list[RankResult]:
    """Root causes first, earliest failure first: ranks that raised, crashed or hung on their own; then ranks whose
    error only says they lost a peer; then the rest (stopped, skipped, passed). Rank order breaks ties."""

    def key(r: RankResult) -> tuple[int, float, int]:
        role = 1 if r.lost_peer else 0 if r.status in (Status.FAILED, Status.CRASHED, Status.HUNG) else 2
        return role, math.inf if r.at is None else r.at, r.rank

    return sorted(results, key=key)


def rank_ranges(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"ranks 0-2,5"``; a single rank reads ``"rank 3"``."""
    ordered = sorted(ranks)
    spans = []
    for _, group in itertools.groupby(enumerate(ordered), key=lambda p: p[1] - p[0]):
        members = [r for _, r in group]
        spans.append(str(members[0]) if len(members) == 1 else f"{members[0]}-{members[-1]}")
    return ("rank " if len(ordered) == 1 else "ranks ") + ",".join(spans)


@dataclass(frozen=True)
class RankGroup:
    """Ranks that ended the same way (same headline and traceback), shown once."""

    ranks: tuple[RankResult, ...]

    @property
    def label(self) -> str:
        return rank_ranges(r.rank for r in self.ranks)

    @property
    def headline(self) -> str:
        return self.ranks[0].headline


def group_ranks(results: Sequence[RankResult]) -> list[RankGroup]:
    """Ranks that ended alike, one group each, in rank order; groups in ``by_cause`` order of their first cause."""
    groups: dict[tuple[str, str], list[RankResult]] = {}
    for r in by_cause(results):
        key = (r.headline, r.error.traceback if r.error else "")
        groups.setdefault(key, []).append(r)
    return [RankGroup(tuple(sorted(g, key=lambda r: r.rank))) for g in groups.values()]


def bounded_output(head: bytes, tail: bytes, total: int) -> str:
    """A rank's output from its first and last bytes: whole when they cover all ``total`` bytes, else the head, a
    line saying how much of the middle was cut, and the tail."""
    if len(head) + len(tail) >= total:
        return (head + tail[len(head) + len(tail) - total :]).decode(errors="replace")
    cut = total - len(head) - len(tail)
    first = head.decode(errors="replace")
    joint = "" if first.endswith("\n") else "\n"
    return (
        f"{first}{joint}{CUT_PREFIX}{cut:,} bytes of this rank's output "
        f"({total:,} in all; the first {len(head):,} and the last {len(tail):,} are kept) ...]\n"
        f"{tail.decode(errors='replace')}"
    )


def _tail(text: str, lines: int = OUTPUT_TAIL_LINES) -> str:
    kept = text.rstrip().splitlines()[-lines:]
    return "\n".join(kept)


def _output_section(rank: int, text: str) -> list[str]:
    """A rank's output under its failure: its last lines; when it was cut, its first lines and the cut too."""
    every = text.rstrip().splitlines()
    cut = next((i for i, line in enumerate(every) if line.startswith(CUT_PREFIX)), None)
    if cut is None:
        return [f"---- rank {rank}: output (last {OUTPUT_TAIL_LINES} lines) ----", _tail(text)]
    head, tail = every[:cut][:OUTPUT_HEAD_LINES], every[cut + 1 :][-OUTPUT_TAIL_LINES:]
    return [
        f"---- rank {rank}: output (first {len(head)} and last {len(tail)} lines of what was kept) ----",
        *head,
        every[cut],
        *tail,
    ]


def left_early(outcome: WorldOutcome) -> list[RankResult]:
    """Ranks that passed and exited before anything failed, when every failure only lost a peer: the likely cause
    (a rank that skipped a collective leaves the others waiting on it until its exit closes their connections)."""
    failures = outcome.failures
    if not failures or not all(r.lost_peer for r in failures):
        return []
    first = min((r.at for r in failures if r.at is not None), default=None)
    if first is None:
        return []
    return [r for r in outcome.ranks if r.status is Status.PASSED and r.at is not None and r.at <= first]


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else text


def describe_failure(outcome: WorldOutcome) -> str:
    """The text a user reads when a world fails: one line per distinct ending, the root cause first (it is what the
    short summary shows), then each story in full."""
    bad = [r for r in outcome.ranks if r.status is not Status.PASSED]
    groups = group_ranks(bad)
    early = left_early(outcome)
    waiting = rank_ranges(r.rank for r in outcome.failures)
    endings = [
        f"rank {r.rank}: passed, but exited at {r.at:.2f}s while {waiting} still waited on it (a skipped collective?)"
        for r in early
        if r.at is not None
    ]
    for g in groups:
        lost = " (lost a peer)" if g.ranks[0].lost_peer else ""
        endings.append(f"{g.label}{lost}: {_first_line(g.headline)}")
    lines = ["; ".join(endings)]
    causes = [r for r in outcome.failures if not r.lost_peer and r.at is not None]
    first = ""
    if len(group_ranks(outcome.failures)) > 1 and causes:
        first = f"; rank {causes[0].rank} failed first, at {causes[0].at:.2f}s"
    reused = ", on ranks kept from an earlier test (reuse=True)" if outcome.reused else ""
    not_kept = f"; not kept for the next test, which gets fresh ranks: {outcome.not_kept}" if outcome.not_kept else ""
    lines.append(f"({outcome.size}-rank {outcome.backend} world{reused}, {outcome.duration:.1f}s{first}{not_kept})")
    for g in groups:
        head = g.ranks[0]
        if head.error is not None:
            lost = " (it lost a peer: a consequence of the ranks above)" if head.lost_peer else ""
            lines += ["", f"---- {g.label}: traceback{lost} ----", head.error.traceback.rstrip()]
        for r in g.ranks:
            if r.stack:
                lines += ["", f"---- rank {r.rank}: Python stacks when {r.status.value} ----", _tail(r.stack, 60)]
            if r.output.strip() and r.status is not Status.STOPPED:
                lines += ["", *_output_section(r.rank, r.output)]
    return "\n".join(lines)


def describe_exit(returncode: int) -> str:
    """A process's ending in words, from ``subprocess``'s return code (negative: the signal that killed it)."""
    if returncode < 0:
        try:
            return f"killed by signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"
