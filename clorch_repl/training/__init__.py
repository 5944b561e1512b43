"""What a training loop uses beside the process group: DDP, the resumable sampler, mixed
precision, and checkpoints of all of it.

* :mod:`.ddp`: ``distributed_data_parallel``, ``no_sync``, ``optimizer_step`` (public name
  ``clorch_repl.parallel``);
* :mod:`.sampler`: ``distributed_sampler`` (public name ``clorch_repl.data``);
* :mod:`.amp`: ``autocast``, ``grad_scaler``, ``backward`` (public name ``clorch_repl.amp``);
* :mod:`.checkpoint`: ``save_checkpoint``/``load_checkpoint`` of the model, optimizer, sampler,
  scaler and RNG states (public names ``clorch_repl.distributed.save_checkpoint``/``load_checkpoint``).

The public names are API.md's, the seed's namespaces; this package is where the code lives.
Nothing is imported here, so importing one part does not import the others.
"""
