"""treegather's benchmarks: each one a module with its own command line.

- ``python -m treegather.benchmarks`` (:mod:`~treegather.benchmarks.scatter_gather`): scatter
  and gather against the bare torch ops, a torch ``scatter_gather``-style recursion, optree and
  ``torch.utils._cxx_pytree``; then the compiled layer's rows
  (:mod:`~treegather.benchmarks.engine`);
- ``python -m treegather.benchmarks.steps``: a data-parallel training step against the same
  shards run through the module directly;
- ``python -m treegather.benchmarks.distributed``: ``treegather.distributed.all_gather`` on
  gloo ranks against one collective of the payload and what users write by hand;
- ``python -m treegather.benchmarks.evaluation``: a ``treegather.distributed.Collector``
  evaluation (the final exchange, the cost of one ``add``, the collectives of
  ``all_gather(sync_grads=True)``);
- ``python -m treegather.benchmarks.apply``: the ``parallel_apply`` backends.
- ``python -m treegather.benchmarks.gpu OUT_DIR [--cpu]`` (:mod:`~treegather.benchmarks.gpu`):
  the GPU check, one prepared command for one CUDA device (``--cpu``: its dry run).

How each one times, and the last measured tables, are in ``treegather/benchmarks/README.md``.
Nothing here is imported by ``import treegather``.
"""
