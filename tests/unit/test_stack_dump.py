"""A stuck rank's faulthandler stack, as the notebook reads it (clorch_repl.host.rankfiles):
the main thread only, cut where IPython called the cell, in both formats faulthandler writes.

Ranks dump their main thread alone (``Stack (most recent call first):``): a dump of every thread
from a signal handler reads the other threads' frames without the GIL, and crashed a rank stuck in
a gloo barrier in CI. Dumps of every thread are still read (a rank of an older clorch_repl).
"""

from __future__ import annotations

from clorch_repl.host.rankfiles import main_thread_stack
from clorch_repl.session.cell_end import idle_in_event_loop

SITE = "/v/lib/python3.11/site-packages"
PY = "/py/lib/python3.11"
BASE = f'''  File "{SITE}/IPython/core/interactiveshell.py", line 3701 in run_code
  File "{SITE}/IPython/core/interactiveshell.py", line 3641 in run_ast_nodes
  File "/w/clorch_repl/kernel/rank_kernel.py", line 58 in do_execute
  File "{PY}/asyncio/base_events.py", line 607 in run_forever
  File "/w/clorch_repl/kernel/app.py", line 138 in main
  File "<frozen runpy>", line 198 in _run_module_as_main
'''
IN_BARRIER = f'''  File "{SITE}/torch/distributed/distributed_c10d.py", line 4791 in barrier
  File "Cell In[2]", line 5 in <module>
''' + BASE
MAIN_ONLY = "Stack (most recent call first):\n" + IN_BARRIER
EVERY_THREAD = (f'Thread 0x00007f9500000700 (most recent call first):\n  File "{PY}/threading.py", line 331 in wait\n'
                f'  File "{SITE}/ipykernel/iostream.py", line 100 in _thread_main\n\n'
                "Current thread 0x00007f95375c9b80 (most recent call first):\n" + IN_BARRIER)


def test_a_main_thread_dump_is_cut_at_the_cell() -> None:
    stack = main_thread_stack(MAIN_ONLY)
    assert stack.splitlines() == [
        "Stack (most recent call first):",
        f'  File "{SITE}/torch/distributed/distributed_c10d.py", line 4791 in barrier',
        '  File "Cell In[2]", line 5 in <module>',
        "  ... (the kernel's own frames)",
    ]
    assert not idle_in_event_loop(MAIN_ONLY)  # in a collective: stuck, not returned


def test_a_dump_of_every_thread_yields_the_same_main_thread() -> None:
    stack = main_thread_stack(EVERY_THREAD)
    assert stack.splitlines()[1:] == main_thread_stack(MAIN_ONLY).splitlines()[1:]
    assert "iostream.py" not in stack


def test_a_main_thread_idle_between_cells_reads_as_returned() -> None:
    idle = ("Stack (most recent call first):\n"
            f'  File "{PY}/selectors.py", line 468 in select\n'
            f'  File "{PY}/asyncio/base_events.py", line 1884 in _run_once\n'
            f'  File "{PY}/asyncio/base_events.py", line 607 in run_forever\n'
            '  File "/w/clorch_repl/kernel/app.py", line 138 in main\n')
    assert idle_in_event_loop(idle)


def test_a_dump_of_another_thread_is_no_place_of_the_rank() -> None:
    """The signal landed on a kernel thread (iopub's): that thread's stack is not the rank's place."""
    other = ("Stack (most recent call first):\n"
             f'  File "{PY}/threading.py", line 331 in wait\n'
             f'  File "{SITE}/ipykernel/iostream.py", line 100 in _thread_main\n')
    assert main_thread_stack(other) == ""


def test_both_views_of_a_stack_cut_at_the_same_frame() -> None:
    # The report (faulthandler text) and the live probe (frame records) share the rule: a dump line
    # and a frame naming IPython's run_code are the cell's caller; a user's own run_code is not.
    from clorch_repl.common.cell_boundary import calls_the_cell, dump_line_calls_the_cell

    assert dump_line_calls_the_cell(f'  File "{SITE}/IPython/core/interactiveshell.py", line 3701 in run_code')
    assert calls_the_cell(f"{SITE}/IPython/core/interactiveshell.py", "run_code")
    assert not dump_line_calls_the_cell('  File "/home/me/train.py", line 12 in run_code')
    assert not calls_the_cell("/home/me/train.py", "run_code")
    assert not calls_the_cell(f"{SITE}/IPython/core/interactiveshell.py", "run_cell")
