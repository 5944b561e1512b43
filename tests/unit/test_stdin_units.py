"""A rank at a prompt that did not answer the probe is still named held. Prompts of real ranks:
tests/integration/test_stdin.py."""

from __future__ import annotations


def test_a_rank_at_a_prompt_that_did_not_answer_the_probe_is_still_named_held() -> None:
    # The live notice's analysis alone, on the evidence it has when a loaded rank's probe times out:
    # its faulthandler stack (text as faulthandler writes it).
    from clorch_repl.diagnosis.entries import RankEvidence
    from clorch_repl.diagnosis.where import where

    in_pdb = RankEvidence(1, prompt="ipdb> ", fallback_stack=(
        "Thread 0x00007f (most recent call first):\n"
        '  File "/usr/lib/python3.11/bdb.py", line 90 in dispatch_line\n'
        '  File "/tmp/ipykernel_1/2.py", line 5 in step\n'))
    assert where(in_pdb) == "is held in the debugger (its prompt 'ipdb> ' waits for your answer in the notebook)"
    at_input = RankEvidence(1, prompt="name? ", fallback_stack='  File "/tmp/ipykernel_1/2.py", line 2 in <module>\n')
    assert where(at_input) == "is waiting for input (its prompt 'name? ' waits for your answer in the notebook)"
