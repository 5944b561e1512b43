"""A rank's faulthandler stack names its cells as the notebook shows them (clorch_repl.session.cell_files).

The end-to-end cases (a rank holding its GIL, a crash, a rank ignoring the interrupt) are in
test_hang_notebook.py, test_session.py and test_notebook_kernel.py; these pin down which cell a
file is named after. The file names are made by ipykernel's own compiler, as a rank's kernel does.
"""

from __future__ import annotations

from ipykernel.compiler import get_file_name

from clorch_repl.session.cell_files import CellNames


def frame(code: str, line: int, function: str = "<module>") -> str:
    return f'  File "{get_file_name(code)}", line {line} in {function}\n'


def test_a_cell_file_is_named_after_the_newest_run_of_that_cell() -> None:
    names = CellNames()
    names.add("step()", 3, [0, 1])
    names.add("def step():\n    sleep()", 4, [0, 1])
    names.add("step()", 7, [0, 1])  # the same cell run again
    text = frame("def step():\n    sleep()", 2, "step") + frame("step()", 1)
    assert names.name(text, 1) == ('  File "Cell In[4]", line 2 in step\n'
                                   '  File "Cell In[7]", line 1 in <module>\n')


def test_a_cell_is_named_as_each_rank_ran_it() -> None:
    names = CellNames()
    names.add("def work():\n    wait()", 3, [0, 1])
    names.add("def work():\n    wait()", 4, [1])  # the same text again, %%distributed --ranks 1
    text = frame("def work():\n    wait()", 2, "work")
    assert names.name(text, 0) == '  File "Cell In[3]", line 2 in work\n'
    assert names.name(text, 1) == '  File "Cell In[4]", line 2 in work\n'
    assert names.name(text, 2) == text  # a rank that never ran it


def test_files_of_cells_it_did_not_send_keep_their_path() -> None:
    names = CellNames()
    names.add("x = 1", 1, [0])
    foreign = frame("print('from another client')", 5)
    library = '  File "/usr/lib/python3.11/threading.py", line 320 in wait\n'
    assert names.name(foreign + library, 0) == foreign + library


def test_only_the_recent_cells_are_kept() -> None:
    names = CellNames(kept=2)
    for number, code in enumerate(["a = 1", "b = 2", "c = 3"], start=1):
        names.add(code, number, [0])
    assert names.name(frame("a = 1", 1), 0) == frame("a = 1", 1)  # forgotten
    assert names.name(frame("c = 3", 1), 0) == '  File "Cell In[3]", line 1 in <module>\n'


def test_a_cell_file_is_known_by_its_hash_whatever_the_rank_named_its_folder() -> None:
    # A rank names its cells in a folder all the user's ranks share (clorch_repl.kernel.cell_files),
    # or in ipykernel's own per process where that one is not safe: the notebook knows the file by
    # the hash in its name, a cell it sent that rank, not by the folder.
    from ipykernel.compiler import get_tmp_hash_seed, murmur2_x86

    names = CellNames()
    names.add("step()", 3, [0, 1])
    cell = murmur2_x86("step()", get_tmp_hash_seed())
    for folder in ("/tmp/clorch_cells_1000", "/tmp/ipykernel_4711", "/scratch/u/tmp/clorch_cells_7"):
        assert names.name(f'  File "{folder}/{cell}.py", line 1 in <module>\n', 1) == \
            '  File "Cell In[3]", line 1 in <module>\n'
    numbered = '  File "/home/u/runs/2024.py", line 1 in <module>\n'  # digits, but no cell's hash
    assert names.name(numbered, 0) == numbered
