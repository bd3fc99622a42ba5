"""Worlds: the fork server (``server``), the ranks it forks (``rank``), the pytest process's handle on them
(``client``), the typed messages between them (``protocol``) and running in place under a launcher (``launcher``).

torch is imported only inside the server and the ranks (and by the launcher path, which is a rank). Never imports
the pytest side.
"""
