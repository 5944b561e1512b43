"""DDP training with gradient accumulation, mixed precision and resumable checkpoints, from the
command line:

    python examples/distributed_training.py --devices 0,1 --epochs 4 --precision bfloat16

The code lives in the package, :mod:`clorch_repl.examples.distributed_training`, so that notebooks
and launched ranks import it wherever they were started (``from
clorch_repl.examples.distributed_training import run_local``). This script is its front end, and
re-exports its names so that ``from examples.distributed_training import run_local`` keeps working
from the repository's root.
"""

from __future__ import annotations

from clorch_repl.examples.distributed_training import (  # noqa: F401 (re-exported)
    DEFAULTS,
    TrainingResult,
    main,
    make_data,
    make_model,
    run_local,
    train,
    train_worker,
)

__all__ = ["run_local", "train_worker", "train", "make_model", "make_data", "TrainingResult", "DEFAULTS", "main"]

if __name__ == "__main__":
    raise SystemExit(main())
