"""Runs in the pytest process: its handle on one fork server, and the one loop that reads the server's messages.

Every message of ``protocol`` that the server sends is received in one place (``ForkServer.wait_for``) and dispatched
by its class in one other (``ForkServer.dispatch``): the server's own news (``Building``, ``Hello``, ``BuildEnded``)
is kept here, a world's (``Spawned``, ``Exited``, ``Finished``, ``OpWait``, ``WorldEnded``, ``Reaped``) goes to the
world that waits (``world_run.WorldRun.take``). Whoever waits says for what (``until``) and until when.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from ...core import versions
from ...core.errors import HarnessError
from ..protocol import (
    BuildEnded,
    Building,
    ClientMessage,
    Exited,
    FinishBuild,
    Finished,
    Hello,
    OpWait,
    Reaped,
    ServerFacts,
    ServerMessage,
    Spawned,
    WorldEnded,
)
from .gpu_probe import Gpu
from .server_process import ServerGone, ServerProcess, told_log


class RunStops(HarnessError):
    """No world of this run can be judged, whichever test asks: the run stops, saying why in one line."""


class WrongRelease(RunStops):
    """The fork server imported another DeepSpeed than this pytest process resolves: every verdict would be about a
    release the ranks did not run."""


class CacheUnusable(RunStops):
    """The cache directory can serve no world: DeepSpeed's comm op can be neither loaded from it nor built in it."""


#: While DeepSpeed's comm op builds, how often the user is told it still does.
PROGRESS_EVERY = 30.0
#: How long the end of a run waits for the server's answer to ``FinishBuild``. It answers at once, unless it is busy
#: preparing a world that was given up on (importing a list it found: seconds): past that it is stopped as after
#: Ctrl-C.
FINISH_WAIT = 15.0


Progress = Callable[[str], None]


def _silent(text: str) -> None:
    pass


WorldMessage = Spawned | Exited | Finished | WorldEnded | Reaped | OpWait


class WorldListener(Protocol):
    """What waits for a world's messages (``world_run.WorldRun``)."""

    world_id: int

    def take(self, message: WorldMessage) -> None: ...


class ServerNews:
    """The server's news of itself, kept as it comes: its ``Hello``, and a comm-op build (or a first preload) it says
    is running or has ended. ``take`` answers what to tell the user of it, in words (a first build takes minutes).
    A server closed hears nothing more: the next one it starts starts with news of its own."""

    def __init__(self) -> None:
        self.hello: Hello | None = None
        self.build_ended = False
        self.building: float | None = None  # since when the server has been building, as it said between worlds

    def take(self, message: Hello | Building | BuildEnded | None, between_worlds: bool) -> str | None:
        """Keep what ``message`` says (None: ``PROGRESS_EVERY`` seconds, or a wait's end, passed in silence, which
        between worlds a build still running is told as); the words for the user, if any."""
        match message:
            case None:
                if between_worlds and self.building is not None:
                    return f"... still building ({time.monotonic() - self.building:.0f}s)"
            case Building(what=what):  # a comm-op build or a first preload: what it does, and how long
                if between_worlds:
                    self.building = time.monotonic()
                return what
            case Hello(facts=facts):
                self.hello, building, self.building = message, self.building, None
                if building is not None and facts.fatal is None and not facts.builds_beside:
                    took = time.monotonic() - building
                    return f"DeepSpeed's CPU comm op ready after {took:.0f}s; later runs load it from the cache"
            case BuildEnded(what=what):
                self.build_ended, self.building = True, None
                return what or None
        return None


class ForkServer:
    """One preloaded interpreter (``worlds.server``) per pytest process and DeepSpeed accelerator, started on first
    use.

    ``progress`` is told, in words, what a slow start is doing (a first comm-op build takes minutes). ``accelerator``:
    DeepSpeed's in its ranks (``DS_ACCELERATOR``, unless the user set it); ``gpus``: the machine's, as the pytest
    process found them (the server never asks: see ``gpu_probe``).
    """

    def __init__(
        self,
        cache_dir: Path,
        startup_timeout: float,
        progress: Progress = _silent,
        *,
        accelerator: str = "cpu",
        gpus: tuple[Gpu, ...] = (),
    ) -> None:
        self.process = ServerProcess(cache_dir, accelerator, gpus)
        self.startup_timeout = startup_timeout
        self.progress = progress
        self.gpus = gpus
        self.facts: ServerFacts | None = None
        self.refused: str | None = None  # why it could not get ready, when it said so: it is not started again
        self._launched = 0.0  # when ``launch`` started it (monotonic)
        self.news = ServerNews()
        self.heard = 0.0  # when the server last said anything (monotonic)

    def launch(self, deepspeed: bool = False) -> None:
        """Start the server without waiting for it (``start`` waits); ``deepspeed``: its first world uses DeepSpeed,
        so that what its ranks need first is prepared beside the comm-op build (``worlds.server.preload.scout``)."""
        if self.process.started:
            return
        self.process.launch(deepspeed)
        self._launched = time.monotonic()

    def start(self, deepspeed: bool = False) -> ServerFacts:
        """Start the server (``launch``), if it was not, and wait until it is ready."""
        if self.facts is not None:
            return self.facts
        if self.refused is not None:  # not started again, only to fail the same way minutes later
            raise HarnessError(f"the pytest-dsrepro fork server {self.refused}, when this run's first world started it")
        self.launch(deepspeed)
        try:
            hello = self._hello()
            failure = f"did not start: no answer within {self.startup_timeout:g}s"
        except ServerGone as exc:
            hello = None
            after = time.monotonic() - self._launched
            failure = f"ended ({exc.ending}) {after:.1f}s after it was started, before it was ready"
        if hello is None or hello.facts.fatal is not None:
            self.process.stop()
            log = self.process.log_tail()
            self.close()
            if hello is not None:
                if hello.facts.stops_run:
                    raise CacheUnusable(hello.facts.fatal)
                self.refused = f"could not get ready ({hello.facts.fatal})"  # the same for every later world
                failure = self.refused
            raise HarnessError(f"the pytest-dsrepro fork server {failure}; {told_log(log)}")
        wrong = _other_release(hello.facts)
        if wrong is not None:
            self.process.stop()
            self.close()
            raise WrongRelease(wrong)
        gpus = tuple(g.name for g in self.gpus)
        self.facts = dataclasses.replace(hello.facts, cuda_devices=len(gpus), gpus=gpus)
        return self.facts

    def _hello(self) -> Hello | None:
        """Wait for ``Hello`` (``ServerNews`` tells what a comm-op build is doing meanwhile, and when it is done)."""
        self.wait_for(lambda: self.news.hello is not None, time.monotonic() + self.startup_timeout)
        return self.news.hello

    def noted_preload(self, preloaded: str | None, fork_hazard: str | None = None) -> None:
        """Keep with its facts what the server imported ahead of its ranks, once it has (``Spawned.preloaded``), and
        what made a fork of it unsafe, if anything ever did (``Spawned.fork_hazard``)."""
        if self.facts is None:
            return
        if preloaded is not None and self.facts.preloaded != preloaded:
            self.facts = dataclasses.replace(self.facts, preloaded=preloaded)
        if fork_hazard is not None and self.facts.fork_hazard is None:
            self.facts = dataclasses.replace(self.facts, fork_hazard=fork_hazard)

    def send(self, message: ClientMessage) -> None:
        """``ServerGone`` when the server is not running or died."""
        self.process.send(message)

    def receive(self, timeout: float) -> ServerMessage | None:
        """The next message, or None when none came within ``timeout``; ``ServerGone`` as soon as the server is gone."""
        return self.process.receive(timeout)

    def wait_for(
        self, until: Callable[[], bool], deadline: float, world: WorldListener | None = None, silence: float = math.inf
    ) -> bool:
        """The one loop over the server's messages: each is dispatched (``dispatch``; ``world``'s go to it) until
        ``until()`` holds (True), or ``deadline`` (``time.monotonic()``) passes, or the server says nothing for
        ``silence`` seconds (False). ``ServerGone`` as soon as the server is gone."""
        since = time.monotonic()
        while not until():
            left = min(deadline, max(since, self.heard) + silence) - time.monotonic()
            if left <= 0:
                return False
            self.dispatch(self.receive(min(left, PROGRESS_EVERY)), world)
        return True

    def dispatch(self, message: ServerMessage | None, world: WorldListener | None = None) -> None:
        """Every message the server sends, by its class; None: ``PROGRESS_EVERY`` seconds (or a wait's end) passed in
        silence, which between worlds a build still running is told as."""
        if message is not None:
            self.heard = time.monotonic()
        match message:
            case Spawned() | Exited() | Finished() | WorldEnded() | Reaped() | OpWait():
                if world is not None and message.world == world.world_id:
                    world.take(message)
            case _:
                said = self.news.take(message, between_worlds=world is None)
                if said is not None:
                    self.progress(said)

    @property
    def alive(self) -> bool:
        return self.process.alive

    def finish_build(self) -> None:
        """The run is over, uninterrupted: op builds still running beside the worlds (the comm op's first, or one a
        rank asked for) go on apart for later runs, which then load the ops, instead of being thrown away with the
        server; the server says so (or how a build that ended did) at once, and nothing waits for the builds. Ctrl-C
        meanwhile, or a server that does not answer within ``FINISH_WAIT``: ``close`` stops it, and the builds with
        it."""
        if not self.alive or self.facts is None or self.facts.deepspeed is None:
            return
        self.news.build_ended = False
        try:
            self.send(FinishBuild())
            if not self.wait_for(lambda: self.news.build_ended, time.monotonic() + FINISH_WAIT):
                self.progress(
                    f"the fork server did not answer within {FINISH_WAIT:g}s at the end of the run (busy with a first "
                    "preload?): stopped with what it was doing, a comm-op build still running included"
                )
        except ServerGone as gone:  # nothing left to hand on; ``close`` cleans up after it
            self.progress(f"the fork server ended before the build did ({gone.ending})")
        finally:
            self.news.building = None

    def close(self) -> None:
        """Stop the server (it kills whatever it started and exits) and remove its log, even when a second Ctrl-C
        cuts the wait for the server short: the server, already told to stop, finishes on its own."""
        try:
            self.process.stop()
        finally:
            self.process.remove_log()
            self.facts, self.news = None, ServerNews()


def _other_release(facts: ServerFacts) -> str | None:
    """Why the server's DeepSpeed is not the one this pytest process resolves, if it is not: every verdict would be
    about a release the ranks did not run."""
    expected = versions.resolved("deepspeed", "deepspeed")
    seen = versions.Release(facts.deepspeed, facts.deepspeed_path)
    if versions.same_release(expected, seen):
        return None
    return (
        f"this pytest resolves deepspeed {expected}, but the ranks import deepspeed {seen}; every verdict would be "
        "about a release the ranks did not run (a sys.path entry only one of them has: PYTHONPATH, a test directory "
        "pytest inserted, a .pth file?)"
    )
