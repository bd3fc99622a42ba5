"""Inside a rank (forked by the fork server, or a launched pytest process): the rendezvous, the body, its report.

``spawned_rank`` (a forked rank's life, and a kept rank's loop on its link), ``rendezvous`` (the world's store, the
variables, the default process group), ``body`` (fixes, rank fixtures, the body, its ``RankReport``), ``testmodule``
(the test module, asserts rewritten), ``reuse_reset`` (a kept rank put back between two tests), ``namespaces`` (its
modules' and classes' names as forked, and who rebound one), ``leftovers`` (what a test left that cannot be put back,
which ends the world), ``nccl_recorder`` (an NCCL world's flight recorder, dumped when asked).
"""
