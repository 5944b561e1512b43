"""The interactive session behind ``%clorch`` and ``%%distributed``.

Where the ranks run is the business of :mod:`clorch_repl.launchers` (processes, hosts). Here
``channels`` owns the ranks' sockets, ``cell_run`` and ``ledger`` (pure) decide what a cell's
messages mean and when it is over, ``relay`` does the I/O they ask for, ``hang_watch`` the hang
notice, ``sink`` is the contract with what shows output, ``display`` what the notebook shows,
``protocol`` names what crosses between them, ``comms`` carries widgets' comms between the front end
and the ranks, ``transfer``/``values`` move values, ``stdin``/``debugger`` serve prompts and the
debugger panel, and ``session`` composes them; ``wire`` signs the relay's requests and verifies what
the ranks send; ``requests`` writes every request of clorch_repl's own to the ranks (a name and JSON
data). What runs inside the ranks is :mod:`clorch_repl.kernel`.
"""
