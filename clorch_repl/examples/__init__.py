"""Examples shipped inside the package, so that notebooks, launched ranks and scripts import them
by the same name wherever the kernel was started (JupyterLab starts it in the notebook's folder).

``clorch_repl.examples.distributed_training`` holds the training example (``run_local``,
``train``, ``make_model``, ``make_data``); ``examples/distributed_training.py`` in the repository
is its command-line front end.
"""
