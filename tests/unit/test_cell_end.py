"""Whether a rank the relay gave up on had returned (clorch_repl.session.cell_end), on recorded
faulthandler dumps and probe answers: a rank idle in its event loop is never called stuck."""

from __future__ import annotations

from clorch_repl.session.cell_end import idle_in_event_loop, main_thread_block, returned

PY = "/root/.pyenv/versions/3.11.7/lib/python3.11"
SITE = "/work/wt24/.venv/lib/python3.11/site-packages"
KERNEL_BASE = f'''  File "{SITE}/tornado/platform/asyncio.py", line 203 in start
  File "{SITE}/ipykernel/kernelapp.py", line 768 in start
  File "{SITE}/traitlets/config/application.py", line 1080 in launch_instance
  File "/work/wt24/clorch_repl/kernel/app.py", line 138 in main
  File "/work/wt24/clorch_repl/kernel/app.py", line 142 in <module>
  File "<frozen runpy>", line 88 in _run_code
  File "<frozen runpy>", line 198 in _run_module_as_main
'''
#: recorded from a 2-rank gloo session, rank 1 between cells (Relay.stack_of)
IDLE = f'''Current thread 0x00007f95375c9b80 (most recent call first):
  File "{PY}/selectors.py", line 468 in select
  File "{PY}/asyncio/base_events.py", line 1884 in _run_once
  File "{PY}/asyncio/base_events.py", line 607 in run_forever
''' + KERNEL_BASE
#: the same rank inside a cell's print loop (the flood of issue 24), cells named as the notebook does
IN_CELL = f'''Current thread 0x00007f95375c9b80 (most recent call first):
  File "/work/wt24/clorch_repl/kernel/output.py", line 151 in write
  File "{SITE}/IPython/core/interactiveshell.py", line 3171 in write
  File "Cell In[3]", line 2 in <module>
  File "{SITE}/IPython/core/interactiveshell.py", line 3701 in run_code
  File "{SITE}/IPython/core/interactiveshell.py", line 3641 in run_ast_nodes
  File "/work/wt24/clorch_repl/kernel/rank_kernel.py", line 58 in do_execute
  File "{PY}/asyncio/base_events.py", line 1936 in _run_once
  File "{PY}/asyncio/base_events.py", line 607 in run_forever
''' + KERNEL_BASE
#: waiting in a collective (native code: the innermost Python frame is torch's)
IN_COLLECTIVE = f'''Current thread 0x00007f95375c9b80 (most recent call first):
  File "{SITE}/torch/distributed/distributed_c10d.py", line 2820 in all_reduce
  File "Cell In[4]", line 3 in <module>
  File "{SITE}/IPython/core/interactiveshell.py", line 3701 in run_code
''' + KERNEL_BASE
OTHER_THREAD = f'''Thread 0x00007f9500000700 (most recent call first):
  File "{PY}/threading.py", line 331 in wait
  File "{SITE}/ipykernel/iostream.py", line 100 in _thread_main

'''


def test_an_idle_stack_is_idle_and_a_running_one_is_not() -> None:
    assert idle_in_event_loop(IDLE)
    assert not idle_in_event_loop(IN_CELL)
    assert not idle_in_event_loop(IN_COLLECTIVE)
    assert not idle_in_event_loop("")


def test_the_main_thread_is_read_out_of_an_all_threads_dump() -> None:
    dump = OTHER_THREAD + IDLE
    assert main_thread_block(dump).startswith("Current thread")
    assert idle_in_event_loop(dump)
    assert not idle_in_event_loop(OTHER_THREAD + IN_COLLECTIVE)


def test_the_probe_answer_comes_first() -> None:
    # a top-level-await cell suspended in its await: the stack looks idle, the rank says it runs
    assert not returned({"in_cell": True, "stack": []}, IDLE)
    assert returned({"in_cell": False, "stack": []}, IN_CELL)
    # no answer (native code holds its GIL), or an answer with an error: the stack decides
    assert returned(None, IDLE)
    assert not returned({"error": "timed out"}, IN_COLLECTIVE)
    assert not returned(None, "")
