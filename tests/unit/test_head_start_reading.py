"""The head start's reading of a cell (clorch_repl.magics.head_start.split_cell), held to IPython's.

The head start sends a ``%%distributed`` cell's body to the ranks before IPython calls the magic,
so what it sends must be exactly the body IPython will hand the magic. These tests run IPython's
own full transform (``TransformerManager.transform_cell``, the static part of what the shell
runs) on the same cells and compare: a reading that differs from IPython's on any of them fails.
The integration half (tests/integration/test_head_start.py) runs real notebook kernels and ranks.
"""

from __future__ import annotations

import ast
import random

import pytest
from IPython.core.inputtransformer2 import TransformerManager

from clorch_repl.magics import head_start
from clorch_repl.magics.head_start import ENV, split_cell, wanted


def ipython_reading(manager: TransformerManager, code: str) -> tuple[str, str] | None:
    """(line, body) of the %%distributed call IPython's full transform makes of ``code``, else None."""
    try:
        tree = ast.parse(manager.transform_cell(code))
    except SyntaxError:
        return None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Expr):
        return None
    call = tree.body[0].value
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
            and call.func.attr == "run_cell_magic" and len(call.args) == 3):
        return None
    name, line, body = (ast.literal_eval(arg) for arg in call.args)
    return (line, body) if name == "distributed" else None


#: cells the head start must read (and read as IPython does)
SENT = [
    "%%distributed\npass",
    "%%distributed\npass\n",
    "%%distributed --ranks 0\nprint(1)\n",
    "%%distributed  --timeout 5 \nx = 1\n",
    "\n\n%%distributed\nx = 1",
    "   \n\t\n%%distributed\nx = 1",
    "%%distributed\nx = 1\n   \n\ty = 2\n",  # IPython's dedent empties whitespace-only lines
    "%%distributed\n    indented = 1\n    again = 2",
    "  %%distributed\n  pass",  # all of it indented: IPython dedents the whole cell first
    "%%distributed\n>>> x = 1\n>>> print(x)",  # a pasted doctest: IPython strips the prompts
    "%%distributed\nIn [1]: x = 1\n   ...: y = 2",
    "%%distributed\n'''\n>>> x\n'''\n",
    "%%distributed 'a b' \"c\"\nprint('''a\nb''')",
    "%%distributed\r\npass\r\n",
    "%%distributed\nx = '\u2028'\n",
    "%%distributed\npass\x0cmore\n",
    "%%distributed --gather out\nrank * 2",
    "%%distributed\n\n\n",
    "%%distributed\nprint('ü ∑ 😀')",
]
#: cells that are no %%distributed call, or not one the head start can be sure of
NOT_SENT = [
    "pass",
    "x = 1\n%%distributed\npass",
    "%%distributed?",
    "%%distributed",
    "%%distributed --ranks 0",
    "%%distributedx\npass",
    "%%timeit\npass",
    "%distributed\npass",
    "#%%distributed\npass",
]


@pytest.mark.parametrize("code", SENT)
def test_a_cell_is_read_as_ipython_hands_it_to_the_magic(code: str) -> None:
    manager = TransformerManager()
    expected = ipython_reading(manager, code)
    assert expected is not None, "the corpus entry is no %%distributed call for IPython itself"
    assert split_cell(manager, code) == expected


@pytest.mark.parametrize("code", NOT_SENT)
def test_other_cells_are_not_sent(code: str) -> None:
    assert split_cell(TransformerManager(), code) is None


@pytest.mark.filterwarnings("ignore:`make_tokens_by_line`:UserWarning")  # IPython's own, on odd line ends
def test_random_cells_are_read_as_ipython_reads_them() -> None:
    """Cells assembled at random from the awkward pieces: whatever the head start sends is
    what IPython would hand the magic, and it sends every cell IPython hands the magic with a
    body (one without is IPython's own error)."""
    pieces = ["", " ", "\t", "\n", "  \n", "\r\n", ">>> ", "... ", "In [3]: ", "   ...: ", "'''", '"', "x = 1",
              "print(rank)", "%%distributed", "--ranks 0", "\u2028", "\x0c", "\\", "#"]
    rng = random.Random(27)
    manager = TransformerManager()
    sent = 0
    for _ in range(3000):
        head = rng.choice(["%%distributed", "%%distributed ", "\n%%distributed", " %%distributed", "%%distributed\t"])
        code = head + "".join(rng.choice(pieces) for _ in range(rng.randint(0, 8)))
        reading, expected = split_cell(manager, code), ipython_reading(manager, code)
        if expected is not None and expected[1]:
            assert reading == expected, repr(code)
            sent += 1
        else:
            assert reading is None, repr(code)
    assert sent > 500  # the pieces make many real cells, not only ones nobody sends


def test_a_users_cleanup_transform_counts_and_other_line_transforms_stop_the_head_start() -> None:
    manager = TransformerManager()
    manager.cleanup_transforms.append(lambda lines: [line.replace("ONE", "1") for line in lines])
    assert split_cell(manager, "%%distributed\nx = ONE") == ("", "x = 1\n") == ipython_reading(manager, "%%distributed\nx = ONE")
    manager.line_transforms.append(lambda lines: lines)
    assert split_cell(manager, "%%distributed\nx = 1") is None


@pytest.mark.parametrize("value, on", [(None, True), ("1", True), ("", True), (" 0 ", False), ("0", False),
                                       ("yes", True)])
def test_the_switch(value: str | None, on: bool, caplog: pytest.LogCaptureFixture,
                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(head_start, "_warned", set())
    environ = {} if value is None else {ENV: value}
    assert wanted(environ) is on
    assert wanted(environ) is on  # read every cell: a wrong value is said once, not every cell
    assert caplog.text.count("neither 0 nor 1") == (value == "yes")
