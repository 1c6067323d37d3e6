"""The tools around the library: what runs, measures and compares training, not training itself.

A training script needs none of this: it imports ``hvd_compress.torch`` or
``hvd_compress.tensorflow`` (and perhaps ``hvd_compress.spec``), never
``hvd_compress.tools``; nothing in the library imports the tools (a rule test
keeps it so).  Here are:

* :mod:`~hvd_compress.tools.compare`: the ``hvd-compress-compare`` command, the
  matrix of real Horovod runs over compressors, worker counts and link
  bandwidths; its jobs are :mod:`~hvd_compress.tools.plan` (what runs),
  :mod:`~hvd_compress.tools.run` (launching one run),
  :mod:`~hvd_compress.tools.report` (results.csv, results.md, plots) and
  :mod:`~hvd_compress.tools.predict` (the cost model's prediction.md);
* :mod:`~hvd_compress.tools.costmodel`: the alpha-beta step-time model, its fit
  to measured runs and the crossover bandwidths;
* the launchers: :mod:`~hvd_compress.tools.netcap` (capped links: network
  namespaces, a bridge, ``tc``; needs root), :mod:`~hvd_compress.tools.hvdrun`
  (``horovodrun`` less its start-up probe), :mod:`~hvd_compress.tools.nodesrun`
  (simulated nodes), :mod:`~hvd_compress.tools.mwms` (TensorFlow's
  MultiWorkerMirroredStrategy), all starting their processes through
  :mod:`~hvd_compress.tools.workers`;
* :mod:`~hvd_compress.tools.mpi_check`: the numpy reference's multi-rank step
  over mpi4py, checked (``mpirun -np N python -m hvd_compress.tools.mpi_check``);
* :mod:`~hvd_compress.tools.catalogue`: the README's table of compressors,
  generated from the registry;
* :mod:`~hvd_compress.tools.runtools`: the plumbing the example scripts share
  (flags, progress display, the ``--json`` run summary ``compare`` reads back);
* :mod:`~hvd_compress.tools.datasets`: the data the examples train on (digits,
  CIFAR-10 batches) as numpy arrays.

An installed package also carries a copy of the example scripts
(``torch_examples/``, ``tf_examples/``) under ``hvd_compress/tools/examples/``
for ``hvd-compress-compare`` to launch; their source is the repository's
top-level folders of the same names.
"""
