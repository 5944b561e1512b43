"""The pure parts of issue 23, in this process (the fast half): ``%clorch run``'s line, the
agreement of an ``init_process_group`` call with the session's group, torchrun's extra variables,
where a rank looks for a script, and ``clorch-notebook export``'s conversion."""

from __future__ import annotations

import os
from typing import Any

import nbformat
import pytest
from IPython.core.error import UsageError

from clorch_repl.errors import ConfigError, ScriptNotFound
from clorch_repl.kernel.script import resolve
from clorch_repl.kernel.torchrun import GroupFacts, disagreement
from clorch_repl.magics.core import ClorchMagics
from clorch_repl.tools.notebook_export import export_notebook
from clorch_repl.wire.rank_env import torchrun_extras
from clorch_repl.wire.requests import request_code
from clorch_repl.magics.arguments import parse_run
from clorch_repl.session.script_run import RunRequest

PARSER = ClorchMagics._run.parser  # type: ignore[attr-defined]


def test_run_line_options_before_the_script_and_its_own_after() -> None:
    req = parse_run(PARSER, "--ranks 0,1 -i --timeout 30 train.py --ranks 5 --help 'a b'")
    assert req == RunRequest(script="train.py", args=("--ranks", "5", "--help", "a b"), interactive=True,
                             ranks=[0, 1], timeout_s=30.0)
    req = parse_run(PARSER, "-m pkg.train --epochs 2")
    assert req is not None and req.module and req.script == "pkg.train" and req.args == ("--epochs", "2")
    assert req.rank_code() == request_code("script_run", script="pkg.train", args=["--epochs", "2"], module=True,
                                           interactive=False)
    assert req.rank_code(check=True) == request_code("script_check", script="pkg.train", module=True)
    req = parse_run(PARSER, "--no-merge --hang-notice 0 t.py")
    assert req is not None and not req.merge and req.hang_notice_s == 0.0 and req.args == ()


def test_run_help_only_before_the_script(capsys: Any) -> None:
    assert parse_run(PARSER, "--help") is None
    assert "%clorch run" in capsys.readouterr().out
    assert parse_run(PARSER, "t.py --help") == RunRequest(script="t.py", args=("--help",))


@pytest.mark.parametrize("line, words", [
    ("", "%clorch run needs a SCRIPT"),
    ("-m", "%clorch run needs a MODULE"),
    ("-m some/file.py", "-m takes a module name"),
    ("--ranks x t.py", "--ranks"),
    ("--timeout -3 t.py", "--timeout"),
    ("--hang-notice abc t.py", "--hang-notice"),
])
def test_bad_run_lines_are_one_clear_error(line: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words.replace("-", r"\-")):
        parse_run(PARSER, line)


def test_an_unknown_option_before_the_script_is_the_parsers_usage_error() -> None:
    with pytest.raises(UsageError, match="--nproc"):
        parse_run(PARSER, "--nproc 2 t.py")


CPU = GroupFacts(backend="gloo", world_size=2, rank=1, device="cpu")
GPU = GroupFacts(backend="nccl", world_size=8, rank=3, device="cuda:0")


@pytest.mark.parametrize("facts, kwargs", [
    (CPU, {}), (CPU, {"backend": "gloo"}), (CPU, {"backend": "GLOO", "init_method": "env://"}),
    (CPU, {"world_size": 2, "rank": 1}), (CPU, {"world_size": -1, "rank": -1}),
    (GPU, {"backend": "nccl", "device_id": "cuda:0"}), (GPU, {"device_id": 0}), (GPU, {"device_id": "cuda"}),
])
def test_init_calls_that_agree(facts: GroupFacts, kwargs: dict[str, Any]) -> None:
    assert disagreement(facts, **kwargs) == []


@pytest.mark.parametrize("facts, kwargs, words", [
    (CPU, {"backend": "nccl"}, "backend='nccl', but the session's group uses gloo (%clorch start --backend nccl"),
    (GPU, {"backend": "gloo"}, "backend='gloo', but the session's group uses nccl"),
    (GPU, {"backend": "cpu:gloo,cuda:nccl"}, "backend='cpu:gloo,cuda:nccl', but the session's group uses nccl "
                                             "(leave backend out, or pass 'nccl')"),
    (CPU, {"world_size": 4}, "world_size=4, but the session's group has 2 rank(s)"),
    (CPU, {"rank": 0}, "rank=0, but this process is rank 1 of the session's group"),
    (CPU, {"init_method": "tcp://10.0.0.1:29500"}, "init_method='tcp://10.0.0.1:29500' would form a second group"),
    (CPU, {"store": object()}, "store= gives a rendezvous store of its own"),
    (CPU, {"pg_options": object()}, "pg_options cannot change a group that is already formed"),
    (CPU, {"device_id": 0}, "device_id=cuda:0, but this rank has no GPU"),
    (GPU, {"device_id": 3}, "device_id=cuda:3, but this rank's GPU is cuda:0 in its process"),
])
def test_init_calls_that_disagree_name_the_difference(facts: GroupFacts, kwargs: dict[str, Any], words: str) -> None:
    found = disagreement(facts, **kwargs)
    assert len(found) == 1 and found[0].startswith(words), found


def test_every_difference_is_named() -> None:
    assert len(disagreement(CPU, backend="nccl", world_size=3, rank=0)) == 3


def test_torchrun_extras() -> None:
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}
    assert torchrun_extras(env) == {
        "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "ROLE_RANK": "5", "ROLE_NAME": "default",
        "ROLE_WORLD_SIZE": "8", "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": "clorch"}
    assert torchrun_extras({**env, "GROUP_RANK": "1", "TORCHELASTIC_RUN_ID": "job7"}).keys().isdisjoint(
        {"GROUP_RANK", "TORCHELASTIC_RUN_ID"})  # a real torchrun's own values stay
    with pytest.raises(ConfigError, match="RANK, WORLD_SIZE and LOCAL_WORLD_SIZE"):
        torchrun_extras({"RANK": "x", "WORLD_SIZE": "2"})
    uneven = torchrun_extras({"RANK": "0", "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "2"})  # nodes of 2 and 1
    assert "GROUP_RANK" not in uneven and uneven["ROLE_WORLD_SIZE"] == "3"


def test_where_a_rank_looks_for_the_script(tmp_path: Any) -> None:
    script = tmp_path / "train.py"
    script.write_text("print(1)\n")
    target = resolve(str(script), module=False)
    assert target.path == str(script) and target.search_dir == str(tmp_path) and target.module is None
    with pytest.raises(ScriptNotFound, match="no script .* on host .*working directory"):
        resolve(str(tmp_path / "missing.py"), module=False)
    with pytest.raises(ScriptNotFound, match="is a directory"):
        resolve(str(tmp_path), module=False)
    (tmp_path / "nb.ipynb").write_text("{}")
    with pytest.raises(ScriptNotFound, match="clorch-notebook export"):
        resolve(str(tmp_path / "nb.ipynb"), module=False)
    target = resolve("tests.torchrun_scripts.report", module=True)
    assert target.path.endswith(os.path.join("torchrun_scripts", "report.py"))
    assert target.module == "tests.torchrun_scripts.report"
    with pytest.raises(ScriptNotFound, match="package without a __main__"):
        resolve("tests.torchrun_scripts", module=True)
    with pytest.raises(ScriptNotFound, match="no_such_module_here"):
        resolve("no_such_module_here", module=True)


def _notebook(*cells: Any) -> dict[str, Any]:
    nb = nbformat.v4.new_notebook()
    nb.cells = list(cells)
    return nb


def test_export_keeps_the_cells_in_order_with_the_preamble_and_the_ending() -> None:
    md, code = nbformat.v4.new_markdown_cell, nbformat.v4.new_code_cell
    result = export_notebook(_notebook(
        md("# Title\ntext"),
        code("%load_ext clorch_repl\n%clorch start --nproc 2 --backend gloo --timeout 120"),
        code("%%distributed\nx = rank + 1\nprint(x)"),
        code("print('in the notebook')"),
        code("%%distributed --ranks 0,1\ndoc = '''first\nsecond'''\nprint(doc)"),
        code("%%distributed --ranks 1\n"),
    ), "out.py")
    script = result.script
    compile(script, "out.py", "exec")  # it is Python
    assert result.distributed_cells == 3 and result.nproc == "2" and result.warnings == []
    assert "_backend = 'gloo'  # the notebook's %clorch start --backend" in script
    assert "timeout=_datetime.timedelta(seconds=120)" in script
    assert "# %% [markdown]\n# # Title\n# text" in script
    assert "# %% cell 2: %%distributed\nx = rank + 1\nprint(x)" in script
    assert "# %% cell 3: notebook only, not run by the script\n# print('in the notebook')" in script
    assert "if rank in (0, 1):\n    doc = '''first\nsecond'''\n    print(doc)" in script  # the string's text kept
    assert "# %% cell 5: %%distributed --ranks 1\nif rank == 1:\n    pass" in script
    assert script.index("init_process_group") < script.index("x = rank + 1") < script.index("destroy_process_group")
    assert "# %clorch start" in script


def test_export_uses_start_s_backend_rule_without_a_backend() -> None:
    script = export_notebook(_notebook(nbformat.v4.new_code_cell("%%distributed\nprint(rank)"))).script
    assert '_backend = "nccl" if _torch.cuda.is_available() else "gloo"' in script
    assert "timeout=" not in script


def test_export_warns_about_what_the_script_cannot_reproduce() -> None:
    code = nbformat.v4.new_code_cell
    result = export_notebook(_notebook(
        code("lr = 0.1\nsteps = 3\n%clorch push lr"),
        code("%%distributed\nprint(lr * rank)"),
        code("%%distributed --gather out\n%time y = 1\nprint(steps)\nrank"),
        code("%%distributed\nimport torch.distributed as dist\ndist.init_process_group('gloo')\nz = 1\nz"),
        code("%%distributed\ndist.destroy_process_group()"),
        code("%clorch run train.py --epochs 1"),
    ))
    said = "\n".join(result.warnings)
    assert "cell 0: %clorch push lr gave the ranks the notebook's lr" in said
    assert "cell 1 (%%distributed) reads lr, which the ranks got from the notebook (%clorch push in cell 0)" in said
    assert "cell 2 (%%distributed), line 1: %time is IPython syntax" in said
    assert "cell 2 (%%distributed) reads steps, which only the notebook defines (cell 0)" in said
    assert "cell 2 (%%distributed): --gather out gave the notebook each rank's last value" in said
    assert "cell 3 (%%distributed) calls init_process_group()" in said
    assert "cell 3 (%%distributed) ends in an expression whose value the notebook showed" in said
    assert "cell 4 (%%distributed) calls destroy_process_group()" in said
    assert "cell 5: %clorch run train.py --epochs 1 ran a script on the ranks" in said
    assert len(result.warnings) == 9, said
    assert "# %time y = 1\nprint(steps)" in result.script


def test_export_warns_about_a_cell_that_is_not_python() -> None:
    result = export_notebook(_notebook(nbformat.v4.new_code_cell("%%distributed\nawait something()")))
    assert result.warnings == ["cell 0 (%%distributed) is not Python that a script can hold (top-level await, a "
                               "syntax error): the script will not compile until the cell is fixed"]


def test_export_refuses_a_bad_ranks_list() -> None:
    with pytest.raises(ValueError, match="cell 0 .*--ranks"):
        export_notebook(_notebook(nbformat.v4.new_code_cell("%%distributed --ranks a,b\nprint(1)")))


def test_export_warns_about_a_value_shown_from_a_call_and_about_a_restart() -> None:
    """Issue 35: a cell ending in ``total.item()`` showed its value in the notebook and shows nothing
    in the script; a ``%clorch restart`` (a comment in the script) gave later cells fresh ranks."""
    code = nbformat.v4.new_code_cell
    ran_quiet = code("%%distributed\nmodel_step()", execution_count=4)  # ran, showed nothing: it returned None
    shown = code("%%distributed\nbits.item()", execution_count=5,
                 outputs=[nbformat.v4.new_output("display_data", data={"text/plain": "[rank 0] 3"})])
    result = export_notebook(_notebook(
        code("%load_ext clorch_repl\n%clorch start --nproc 2"),
        code("%%distributed\nimport torch\ntotal = torch.ones(2).sum()\ntotal.item()"),
        code("%%distributed\nprint(rank)"),
        ran_quiet,
        shown,
        code("%clorch restart"),
        code("%clorch stop\n%clorch start --nproc 2"),
    ))
    said = "\n".join(result.warnings)
    assert ("cell 1 (%%distributed) ends in a call, total.item(), whose value the notebook shows (unless it is "
            "None); the script computes it and shows nothing: wrap it in print()") in said
    assert "cell 4 (%%distributed) ends in a call, bits.item(), whose value the notebook showed" in said
    assert "cell 2 " not in said and "cell 3 " not in said  # print() and a call the notebook showed nothing for
    assert "cell 5: %clorch restart gave the ranks fresh processes" in said
    assert "cell 6: %clorch start --nproc 2 gave the ranks fresh processes" in said
    assert "cell 0:" not in said  # the first start is the one the preamble stands for
    assert len(result.warnings) == 4, said
