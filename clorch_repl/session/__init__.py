"""The interactive session behind ``%clorch`` and ``%%distributed``.

Where the ranks run is the business of :mod:`clorch_repl.launchers` (processes, hosts). Here
``relay`` owns the ranks' channels, ``display`` what the notebook shows, ``protocol`` names what
crosses between them, ``comms`` carries widgets' comms between the front end and the ranks,
``transfer``/``values`` move values, ``stdin``/``debugger`` serve prompts and the debugger panel,
and ``session`` composes them. ``worker``, ``bootstrap`` and ``rank_kernel`` run inside the
ranks; ``wire`` signs the relay's requests and verifies what the ranks send.
"""
