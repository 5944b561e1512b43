"""The engine's hooks (clorch_repl.session.hooks), without ranks: which stdin a cell gets, the
blocking stdin hook a script writes, and the broker serving two ranks' prompts through it in rank
order. The same on real ranks: tests/integration/test_engine.py."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from clorch_repl.errors import ClorchError
from clorch_repl.notebook.hooks import NotebookHooks
from clorch_repl.session.cell_rules import refuse_dead_or_busy
from clorch_repl.session.hooks import END_OF_FILE, NO_STDIN_HOOK, CellHooks, NoStdin, PlainSink, SessionHooks, stdin_of
from clorch_repl.session.stdin import GATHER_S, StdinBroker


class Answers(CellHooks):
    def __init__(self) -> None:
        self.asked: list[tuple[int, str, bool]] = []

    def answer(self, rank: int, prompt: str, password: bool) -> str:
        self.asked.append((rank, prompt, password))
        if rank == 2:
            raise EOFError
        return f"line {rank}"


class Silent(CellHooks):
    pass


def test_a_cell_gets_the_hooks_own_stdin_only_where_they_answer_prompts() -> None:
    hooks = Answers()
    assert stdin_of(hooks, None) is hooks
    refused = stdin_of(Silent(), None)
    assert isinstance(refused, NoStdin) and "Silent answers no prompts" in refused.why
    assert isinstance(stdin_of(PlainSink(), None), NoStdin)
    given = NoStdin("an agent reads no input")
    assert stdin_of(hooks, given) is given


def test_the_blocking_hook_is_polled_once_and_end_of_file_is_the_eof_answer() -> None:
    hooks = Answers()
    hooks.open(1, "? ", False)
    assert hooks.poll() == "line 1" and hooks.poll() is None
    hooks.open(2, "? ", True)
    assert hooks.poll() == END_OF_FILE
    hooks.open(1, "? ", False)
    hooks.cancel()  # the rank stopped waiting: its answer is dropped
    assert hooks.poll() is None


def test_prompts_arriving_together_are_answered_in_rank_order() -> None:
    hooks, sent = Answers(), []
    broker = StdinBroker(hooks, lambda rank, value: sent.append((rank, value)))
    broker.request(1, {"content": {"prompt": "b? ", "password": False}})
    broker.request(0, {"content": {"prompt": "a? ", "password": True}})
    time.sleep(GATHER_S + 0.02)
    flushed = []
    for _ in range(4):  # each pass: take an answer, open the next prompt
        broker.step({0, 1}, lambda: flushed.append(True))
    assert hooks.asked == [(0, "a? ", True), (1, "b? ", False)]
    assert sent == [(0, "line 0"), (1, "line 1")] and broker.waiting == set()
    assert len(flushed) == 2  # the cell's output is flushed before each prompt opens


def test_a_cell_run_with_no_hooks_at_all_is_told_so_without_naming_nonetype() -> None:
    refused = stdin_of(None, None)
    assert isinstance(refused, NoStdin) and refused.why.startswith(NO_STDIN_HOOK), refused
    assert "NoneType" not in refused.why and "stdin=" in refused.why


class BusyRelay:
    def busy(self) -> list[int]:
        return [1]


def _refusal(hooks: SessionHooks, alive: bool) -> str:
    group = SimpleNamespace(ranks=[SimpleNamespace(rank=r, alive=alive or r == 0, where=f"rank {r}", exit="SIGKILL")
                                   for r in (0, 1)], instead_of_replacing=lambda ranks: "",  # it can replace them
                            instead_of_restarting=lambda: "",  # and restart them
                            dead=lambda ranks: [r for r in ranks if not (alive or r == 0)])  # (Launcher.dead)
    with pytest.raises(ClorchError) as refused:
        refuse_dead_or_busy(group, BusyRelay(), (0, 1), hooks.verbs)  # type: ignore[arg-type]
    return str(refused.value)


def test_the_engines_refusals_name_the_engines_methods_and_the_notebooks_its_magics() -> None:
    assert _refusal(SessionHooks(), alive=True) == ("rank 1 is still running an earlier cell: wait, run "
                                                    "session.interrupt(), or session.restart()")
    assert "session.restart(ranks=[1]) starts it afresh" in _refusal(SessionHooks(), alive=False)
    assert "%clorch" not in _refusal(SessionHooks(), alive=False)
    assert _refusal(NotebookHooks(), alive=True) == ("rank 1 is still running an earlier cell: wait, run "
                                                     "%clorch interrupt, or %clorch restart")
    assert "rank 1 (SIGKILL) is dead: %clorch restart --ranks 1 starts it afresh" in _refusal(NotebookHooks(),
                                                                                            alive=False)


def test_a_busy_refusal_in_a_session_that_cannot_restart_says_what_works_instead() -> None:
    """A detached session refuses %clorch restart: the refusal of a cell while ranks are busy
    offered it anyway ("wait, run %clorch interrupt, or %clorch restart")."""
    group = SimpleNamespace(ranks=[SimpleNamespace(rank=r, alive=True, where=f"rank {r}", exit=None) for r in (0, 1)],
                            instead_of_replacing=lambda ranks: "", instead_of_restarting=lambda: "for fresh ranks, stop",
                            dead=lambda ranks: [])
    with pytest.raises(ClorchError) as refused:
        refuse_dead_or_busy(group, BusyRelay(), (0, 1), NotebookHooks().verbs)  # type: ignore[arg-type]
    said = str(refused.value)
    assert said.endswith("wait, run %clorch interrupt; for fresh ranks, stop") and "%clorch restart" not in said, said
