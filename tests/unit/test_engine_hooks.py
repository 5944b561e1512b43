"""The engine's hooks (clorch_repl.session.hooks), without ranks: which stdin a cell gets, the
blocking stdin hook a script writes, and the broker serving two ranks' prompts through it in rank
order. The same on real ranks: tests/integration/test_engine.py."""

from __future__ import annotations

import time

from clorch_repl.session.hooks import END_OF_FILE, CellHooks, NoStdin, PlainSink, stdin_of
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
