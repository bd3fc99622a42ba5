"""Runs in the fork server: the one world kept for its reuse scope between two tests (``ds_world(reuse=True)``).

pytest asks to keep a world (``Reap(keep=True)``) only when every rank finished its test cleanly; the server keeps
one at most (worlds run one at a time), its ranks alive and waiting on their links, and its ``/dev/shm`` buffers,
which they still map. The next test of the same scope and size runs on them (``protocol.NextTest``); any other
world, or a kept rank's death, ends them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from .. import shm
from ..protocol import NextTest
from ..workdir import LOOPBACK
from .spawning import ForkedWorld
from .store import Store


class KeptWorld:
    """The kept world, if any; ``end`` kills a world's processes (``OpenWorlds.end``)."""

    def __init__(self, end: Callable[[ForkedWorld], None], store: Store) -> None:
        self.end = end
        self.store = store
        self.world: ForkedWorld | None = None

    def keep(self, world: ForkedWorld) -> None:
        if self.world is not None:  # never expected: one world at a time
            self.discard()
        self.world = dataclasses.replace(world, reused=False)

    def resume(self, reuse: str | None, size: int, test: NextTest) -> ForkedWorld | None:
        """The kept world, running ``test``, when it may (same scope, same size, every rank alive and taking it); None
        otherwise, the kept world then ended: one world at a time."""
        kept = self.world
        if kept is None:
            return None
        if reuse is None or kept.reuse != reuse or len(kept.pids) != size or not kept.whole():
            self.discard()
            return None
        self.world = None
        try:
            for link in kept.links:
                link.send(test)
        except OSError:
            self.world = kept
            self.discard()
            return None
        return dataclasses.replace(kept, reused=True)

    def check(self) -> None:
        """A kept rank died: nothing is left to keep."""
        if self.world is not None and not self.world.whole():
            self.discard()

    def discard(self) -> None:
        """End the kept world: its ranks, their links, and the ``/dev/shm`` buffers DeepSpeed named after the store."""
        kept, self.world = self.world, None
        if kept is None:
            return
        self.end(kept)
        for link in kept.links:
            link.close()
        shm.remove_world_buffers(LOOPBACK, self.store.port)
