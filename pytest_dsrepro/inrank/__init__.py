"""What repro bodies call inside a rank: the rank context, the ``ds_engine`` factory, tiny models, backports.

Importing these modules imports no torch: they import it inside the functions that ranks call.
"""
