"""torchrun-style scripts of the tests' own, run unchanged by ``%clorch run`` on live ranks and by
real torchrun (tests/integration/test_run_script.py, tests/integration/test_run_multihost.py)."""
