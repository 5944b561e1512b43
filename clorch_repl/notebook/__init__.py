"""The notebook layer: IPython's side of the engine's hooks (issue 33).

The session (:mod:`clorch_repl.session`) imports no IPython; what a notebook adds lives here: the
rich, rank-labelled display of a cell's output (``display``, ``held_notice``), prompts asked of
the notebook's front end (``front_end``), the ranks' widgets in the notebook kernel's comm
manager (``comms``, ``widget_states``) and on the page (``widget_views``), the notebook kernel's
busy status (``kernel_status``), the bound on IPython's history of relayed text (``hooks``),
JupyterLab's debugger panel on a rank (``debugger``) and the ``%clorch top`` panel (``panel``). ``hooks.NotebookHooks`` hands them to a
session; the magics (:mod:`clorch_repl.magics`) parse what the user typed and call the session.
"""
