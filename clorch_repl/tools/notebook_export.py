"""``clorch-notebook export NB.ipynb [-o OUT.py]``: a notebook's ``%%distributed`` cells as one
script that ``torchrun --nproc-per-node N OUT.py`` (or ``srun ... python OUT.py``) runs with the
notebook's result: the prototype becomes the batch job without copying cells by hand.

What the script holds, in jupytext's percent format (``# %%`` starts a cell, so editors that read
it show the notebook's cells):

* a preamble that does what ``%clorch start`` did: the process group from the environment, with
  ``%clorch start``'s backend rule (its ``--backend`` if the notebook gave one, else NCCL where
  there are GPUs and gloo without), and the names every rank's namespace starts with (``rank``,
  ``local_rank``, ``world_size``, ``device``). Its own imports are private names (``_dist``),
  so a cell that forgot an import fails in the script as it failed in the notebook;
* the ``%%distributed`` cells in order, each at top level (one namespace, as a rank's), a
  ``--ranks 0,2`` subset as ``if rank in (0, 2):``;
* markdown, notebook-only cells and IPython syntax (``%clorch ...``, ``%time``, ``!ls``) as
  comments, so nothing of the notebook is lost;
* the group destroyed at the end, as ``%clorch stop`` does.

Export warns, once each, about what the script cannot reproduce: a ``%clorch push`` (the ranks
got a notebook value), a ``--gather`` (the notebook got the ranks' values), a notebook variable a
distributed cell reads, a cell's last value the notebook showed, IPython syntax in a distributed
cell, and a cell's own ``init_process_group``/``destroy_process_group`` (in a session the group
survives them; under torchrun it does not). The conversion is :func:`export_notebook`, a pure
function of the notebook's JSON; :func:`main` reads and writes the files.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import io
import logging
import os
import shlex
import sys
import tokenize
from dataclasses import dataclass, field
from typing import Any, Mapping

logger = logging.getLogger(__name__)

#: the names a rank's namespace starts with (clorch_repl.kernel.group)
RANK_NAMES = frozenset({"rank", "local_rank", "world_size", "device"})
EXIT_USAGE = 2

PREAMBLE = '''\
# %% clorch preamble: the process group from the environment, as %clorch start forms it
import datetime as _datetime
import os as _os

import torch as _torch
import torch.distributed as _dist

if "RANK" not in _os.environ and "SLURM_PROCID" in _os.environ:  # srun without torchrun
    _os.environ.update(RANK=_os.environ["SLURM_PROCID"], LOCAL_RANK=_os.environ["SLURM_LOCALID"],
                       WORLD_SIZE=_os.environ["SLURM_NTASKS"])
if "MASTER_ADDR" not in _os.environ or "RANK" not in _os.environ:
    raise SystemExit("run this script with torchrun --nproc-per-node N {script} (or under srun with "
                     "MASTER_ADDR and MASTER_PORT exported): it needs RANK, WORLD_SIZE and MASTER_ADDR")
rank = int(_os.environ["RANK"])
local_rank = int(_os.environ.get("LOCAL_RANK", "0"))
world_size = int(_os.environ["WORLD_SIZE"])
{backend_line}
if _backend == "nccl":  # one GPU per rank: torchrun shows every GPU, srun with --gpu-bind only its own
    device = _torch.device("cuda", local_rank % _torch.cuda.device_count())
    _torch.cuda.set_device(device)
else:
    device = _torch.device("cpu")
_dist.init_process_group(_backend, device_id=device if _backend == "nccl" else None{timeout})
'''

ENDING = '''\
# %% clorch: the end leaves the process group, as %clorch stop does
if _dist.is_initialized():
    _dist.destroy_process_group()
'''


@dataclass
class Export:
    """What :func:`export_notebook` made: the script's text and what it cannot reproduce."""

    script: str
    warnings: list[str] = field(default_factory=list)
    distributed_cells: int = 0
    #: ``--nproc`` of the notebook's ``%clorch start``, if it gave one (the command line to print)
    nproc: str | None = None


def _source(cell: Mapping[str, Any]) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else str(source)


def _options(line: str) -> dict[str, str]:
    """``--opt value`` pairs of a magic's line (flags map to ""); unreadable quoting gives none."""
    try:
        tokens = shlex.split(line)
    except ValueError:
        return {}
    found: dict[str, str] = {}
    for i, token in enumerate(tokens):
        if token.startswith("--"):
            name, eq, value = token.partition("=")
            if not eq and i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
                value = tokens[i + 1]
            found[name] = value
    return found


def _comment(text: str) -> str:
    return "\n".join(f"# {line}".rstrip() for line in text.splitlines())


def _strip_ipython(body: str, where: str, warnings: list[str]) -> str:
    """The body with IPython-only lines (``%magic``, ``!shell``) commented out, each warned about."""
    out = []
    for number, line in enumerate(body.splitlines(), 1):
        bare = line.lstrip()
        if bare.startswith(("%", "!")):
            warnings.append(f"{where}, line {number}: {bare.split()[0]} is IPython syntax, which a script does "
                            "not run: it is a comment in the script")
            out.append(line[: len(line) - len(bare)] + "# " + bare)
        else:
            out.append(line)
    return "\n".join(out)


def _parse(code: str) -> ast.Module | None:
    """The code's tree, None when a script cannot hold it (compile also refuses a top-level
    ``await``, which IPython runs and ``ast.parse`` lets pass)."""
    try:
        compile(code, "<cell>", "exec", dont_inherit=True)
        return ast.parse(code)
    except (SyntaxError, ValueError):
        return None


def _stored(tree: ast.AST) -> set[str]:
    """Every name the code binds anywhere: assignments, defs, imports, loop and with targets, arguments."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
    return names


def _loaded(tree: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def _calls(tree: ast.AST, name: str) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if called == name:
                return True
    return False


def _indent(body: str) -> str:
    """``body`` indented one level, except lines inside a multi-line string (their text is data)."""
    inside: set[int] = set()
    try:
        for tok in tokenize.generate_tokens(io.StringIO(body + "\n").readline):
            if tok.type == tokenize.STRING and tok.end[0] > tok.start[0]:
                inside.update(range(tok.start[0] + 1, tok.end[0] + 1))
    except (tokenize.TokenError, SyntaxError, IndentationError) as exc:  # the script shows the same error
        logger.debug("cannot tokenize a cell to indent it: %s", exc)
    lines = body.splitlines()
    return "\n".join(line if (i in inside or not line.strip()) else "    " + line for i, line in enumerate(lines, 1))


def _ranks_condition(text: str) -> str:
    ranks = [int(r) for r in text.replace(" ", "").split(",") if r.strip().isdigit()]
    if not ranks:
        raise ValueError(f"--ranks {text!r} is not a comma-separated list of ranks")
    return f"rank == {ranks[0]}" if len(ranks) == 1 else f"rank in ({', '.join(map(str, ranks))})"


def export_notebook(nb: Mapping[str, Any], script_name: str = "OUT.py") -> Export:
    """The script of a notebook (its nbformat-4 JSON as a dict); see the module docstring."""
    cells = list(nb.get("cells") or [])
    warnings: list[str] = []
    starts = [line.strip() for cell in cells if cell.get("cell_type") == "code"
              for line in _source(cell).splitlines() if line.strip().startswith("%clorch start")]
    start = _options(starts[0][len("%clorch start"):]) if starts else {}  # the first start sets the group
    timeout = f", timeout=_datetime.timedelta(seconds={float(start['--timeout']):g})" \
        if _is_number(start.get("--timeout")) else ""
    parts = [f"# %% [markdown]\n# Exported from a notebook by `clorch-notebook export`: its %%distributed cells in\n"
             f"# order, as one torchrun script. Run it with\n#     torchrun --nproc-per-node "
             f"{start.get('--nproc') or 'N'} {script_name}\n# or `srun ... python {script_name}` with MASTER_ADDR "
             "and MASTER_PORT exported.",
             PREAMBLE.format(backend_line=_backend_line(start.get("--backend")), timeout=timeout, script=script_name)]
    notebook_names: dict[str, int] = {}  # name -> the notebook-only cell that binds it
    pushed: dict[str, int] = {}
    started = [0]
    on_ranks = set(RANK_NAMES) | set(dir(builtins))
    count = 0
    for index, cell in enumerate(cells):
        kind, text = cell.get("cell_type"), _source(cell)
        if kind == "markdown":
            parts.append("# %% [markdown]\n" + _comment(text))
            continue
        if kind != "code":
            parts.append(f"# %% [{kind}]\n" + _comment(text))
            continue
        first, _, body = text.lstrip("\n").partition("\n")
        if not first.strip().startswith("%%distributed"):
            parts.append(_notebook_only(index, text, warnings, notebook_names, pushed, started))
            continue
        count += 1
        where = f"cell {index} (%%distributed)"
        options = _options(first.strip()[len("%%distributed"):])
        code = _strip_ipython(body, where, warnings)
        tree = _parse(code)
        if tree is not None:
            _check_cell(tree, code, where, options, warnings, notebook_names, pushed, on_ranks, _shown(cell))
            on_ranks |= _stored(tree)
        else:
            warnings.append(f"{where} is not Python that a script can hold (top-level await, a syntax error): "
                            "the script will not compile until the cell is fixed")
        if "--gather" in options:
            warnings.append(f"{where}: --gather {options['--gather']} gave the notebook each rank's last value; "
                            "the script has no notebook, and gathers nothing")
        header = f"# %% cell {index}: {first.strip()}"
        if "--ranks" in options:
            try:
                condition = _ranks_condition(options["--ranks"])
            except ValueError as exc:
                raise ValueError(f"{where}: {exc}") from None
            code = f"if {condition}:\n" + (_indent(code) if code.strip() else "    pass")
        parts.append(f"{header}\n{code}".rstrip())
    parts.append(ENDING)
    return Export(script="\n\n".join(p.rstrip("\n") for p in parts) + "\n", warnings=warnings,
                  distributed_cells=count, nproc=start.get("--nproc"))


def _backend_line(backend: str | None) -> str:
    """%clorch start's backend rule: its --backend, else NCCL where there are GPUs and gloo without."""
    if backend:
        return f"_backend = {backend.strip().lower()!r}  # the notebook's %clorch start --backend"
    return '_backend = "nccl" if _torch.cuda.is_available() else "gloo"  # %clorch start\'s default'


def _is_number(text: str | None) -> bool:
    try:
        return text is not None and float(text) > 0
    except ValueError:
        return False


def _notebook_only(index: int, text: str, warnings: list[str], names: dict[str, int], pushed: dict[str, int],
                   started: list[int]) -> str:
    """A notebook-only cell as a comment; what it gives the ranks (``%clorch push``) or takes from
    them (``%clorch restart``, a second ``%clorch start``: every later cell's state) is warned
    about. ``started``: how many ``%clorch start`` lines were seen so far (updated)."""
    plain = []
    for line in text.splitlines():
        bare = line.strip()
        starts_seen = started[0] > 0
        if bare.startswith("%clorch start"):
            started[0] += 1
        if bare.startswith("%clorch push"):
            tokens = bare.split()
            name = tokens[2] if len(tokens) > 2 else "?"
            pushed[name] = index
            warnings.append(f"cell {index}: %clorch push {name} gave the ranks the notebook's {name}; the script "
                            f"has no notebook: define {name} in a %%distributed cell")
        elif bare.startswith("%clorch restart") or (bare.startswith("%clorch start") and starts_seen):
            warnings.append(f"cell {index}: {bare} gave the ranks fresh processes (empty namespaces, new random "
                            "state, a new group); the script goes on in the same processes, so the cells after it "
                            "may print other values than the notebook did: start a second script there instead")
        elif bare.startswith("%clorch run"):
            warnings.append(f"cell {index}: {bare} ran a script on the ranks; the exported script does not: "
                            "run that script with torchrun on its own")
        plain.append("" if bare.startswith(("%", "!")) else line)
    tree = _parse("\n".join(plain))
    if tree is not None:
        for name in _stored(tree):
            names.setdefault(name, index)
    return f"# %% cell {index}: notebook only, not run by the script\n" + _comment(text)


def _shown(cell: Mapping[str, Any]) -> bool | None:
    """Whether the notebook showed a value for this cell (a display or result among its saved
    outputs); None when the notebook does not say (the cell never ran, or its outputs were cleared)."""
    if cell.get("execution_count") is None and not cell.get("outputs"):
        return None
    return any(o.get("output_type") in ("execute_result", "display_data") for o in cell.get("outputs") or [])


#: functions and methods that return None (a cell ending in a call of one shows no value): builtins,
#: torch's that cells end in, and the list and dict methods
_NONE_CALLS = frozenset({"print", "exec", "setattr", "delattr", "breakpoint", "init_process_group",
                         "destroy_process_group", "barrier", "backward", "zero_grad", "step", "sleep", "set_device",
                         "set_epoch", "append", "extend", "sort", "update", "clear"})


def _check_cell(tree: ast.Module, code: str, where: str, options: dict[str, str], warnings: list[str],
                notebook_names: dict[str, int], pushed: dict[str, int], on_ranks: set[str],
                shown: bool | None = None) -> None:
    """Warn about what of this distributed cell the script cannot reproduce."""
    mine = _stored(tree)
    for name in sorted(_loaded(tree) - mine - on_ranks):
        if name in pushed:
            warnings.append(f"{where} reads {name}, which the ranks got from the notebook (%clorch push in cell "
                            f"{pushed[name]}): in the script it is a NameError")
        elif name in notebook_names:
            warnings.append(f"{where} reads {name}, which only the notebook defines (cell {notebook_names[name]}): "
                            "in the script it is a NameError; define it in a %%distributed cell")
    if _calls(tree, "init_process_group"):
        warnings.append(f"{where} calls init_process_group(): the script's preamble formed the group already, and "
                        "under torchrun a second call raises; guard it with `if not dist.is_initialized():`")
    if _calls(tree, "destroy_process_group"):
        warnings.append(f"{where} calls destroy_process_group(): in the notebook the session's group survived it; "
                        "in the script the cells after it run without a group")
    last = tree.body[-1] if tree.body else None
    if not isinstance(last, ast.Expr) or code.rstrip().endswith(";") or "--gather" in options:
        return
    if not isinstance(last.value, ast.Call):
        warnings.append(f"{where} ends in an expression whose value the notebook showed; the script computes it "
                        "and shows nothing: wrap it in print() for the same output")
        return
    # A call's value is shown unless it is None: print() never, total.item() always. The notebook's
    # saved outputs say which (a call that showed nothing returned None); without them, warn.
    func = last.value.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if name in _NONE_CALLS or shown is False:
        return
    call = ast.get_source_segment(code, last.value) or "the call"
    call = call if len(call) <= 40 else call[:37] + "..."
    showed = "showed" if shown else "shows (unless it is None)"
    warnings.append(f"{where} ends in a call, {call}, whose value the notebook {showed}; the script computes it "
                    "and shows nothing: wrap it in print() for the same output")


# ------------------------------------------------------------------------------ the command
def add_parser(commands: Any) -> None:
    """``export``'s arguments, on ``clorch-notebook``'s subcommands."""
    export = commands.add_parser("export", help="turn a notebook's %%distributed cells into a torchrun script",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    export.add_argument("notebook", help="the .ipynb file")
    export.add_argument("-o", "--output", default=None, metavar="OUT.py",
                        help="where to write the script (default: the notebook's name with .py, beside it)")


def main(args: argparse.Namespace) -> int:
    """Read, convert, write; the warnings go to stderr. 0 when written, 2 for bad input."""
    import nbformat

    path = args.notebook
    out = args.output or os.path.splitext(path)[0] + ".py"
    if os.path.abspath(out) == os.path.abspath(path):
        return _usage(f"-o {out} is the notebook itself; give the script another name")
    try:
        nb = nbformat.read(path, as_version=4)
    except FileNotFoundError:
        return _usage(f"no notebook {path!r}")
    except (OSError, ValueError, nbformat.reader.NotJSONError) as exc:
        return _usage(f"cannot read {path!r} as a notebook: {exc}")
    try:
        result = export_notebook(nb, os.path.basename(out))
    except ValueError as exc:
        return _usage(f"{path}: {exc}")
    try:
        with open(out, "w", encoding="utf-8") as fh:
            fh.write(result.script)
    except OSError as exc:
        return _usage(f"cannot write {out!r}: {exc}")
    for warning in result.warnings:
        print(f"clorch-notebook export: warning: {warning}", file=sys.stderr)
    print(f"clorch-notebook export: wrote {out} ({result.distributed_cells} %%distributed cell(s), "
          f"{len(result.warnings)} warning(s)); run it with: torchrun --nproc-per-node {result.nproc or 'N'} {out}")
    return 0


def _usage(message: str) -> int:
    print(f"clorch-notebook export: {message}", file=sys.stderr)
    return EXIT_USAGE


__all__ = ["Export", "export_notebook", "add_parser", "main"]
