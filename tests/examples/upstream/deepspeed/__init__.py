# The checkout's own DeepSpeed sources stand here, unbuilt. tests/conftest.py puts this directory first on sys.path;
# the tests must still run against the DeepSpeed installed in the environment.
raise ImportError("the checkout's unbuilt deepspeed/ was imported instead of the installed release")
