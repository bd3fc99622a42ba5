"""``--ds-scan`` and ``dsrepro scan``: a user's DeepSpeed config run through the catalogue, a pytest plugin of its
own beside the plugin (``scanner``: the entry point ``dsrepro-scan``; nothing imports it). ``defaults`` asks the
scanned release for the config's defaults through ``probe``, which runs in a subprocess of that release's
interpreter (the one module here that imports torch and DeepSpeed). What a scan decides is pure: ``core``'s
``userconfig``, ``ds_defaults``, ``premises`` and ``scan_verdicts``.
"""
