"""``dsrepro triage``'s own package: a pasted log read (``logread``), one bug's faces scored against it
(``evidence``), the catalogue and the known fixes ranked (``ranking``), and what triage knows besides the catalogue
(``known_fixes``, ``ledger``). Only the commands import it: the pytest process, the fork server and the ranks never
load a line of it."""
