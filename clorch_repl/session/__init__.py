"""The engine behind ``%clorch`` and ``%%distributed``, without IPython: a session of ranks that a
notebook, a script, the release check or an agent drives (``engine`` is its public face, ``hooks``
the contract with whoever drives it; the notebook's side of the hooks is :mod:`clorch_repl.notebook`).

Where the ranks run is the business of :mod:`clorch_repl.launchers` (processes, hosts). Here
``channels`` owns the ranks' sockets, ``cell_run`` and ``ledger`` (pure) decide what a cell's
messages mean and when it is over, ``relay`` does the I/O they ask for, ``hang_watch`` the hang
notice, ``sink`` and ``hooks`` are the contract with what shows output and answers prompts,
``protocol`` names what crosses between them, ``transfer`` moves values, ``stdin`` serves prompts
through the cell's stdin hook, and ``session`` composes them; ``wire`` signs the relay's requests
and verifies what the ranks send, and writes every request of clorch_repl's own to the ranks (a
name and JSON data). What runs inside the ranks is :mod:`clorch_repl.kernel`.
"""
