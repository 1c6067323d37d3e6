"""The tools around the library: what runs, measures and compares training, not training itself.

A training script needs none of this: it imports ``hvd_compress.torch`` or
``hvd_compress.tensorflow`` (and perhaps ``hvd_compress.spec``), never
``hvd_compress.tools``.  Here are:

* :mod:`~hvd_compress.tools.compare`: the ``hvd-compress-compare`` command, the
  matrix of real Horovod runs over compressors, worker counts and link
  bandwidths, with its tables, plots and predictions;
* :mod:`~hvd_compress.tools.netcap`: capped links (network namespaces, a
  bridge, ``tc``) and launching Horovod across them; needs root;
* :mod:`~hvd_compress.tools.costmodel`: the alpha-beta step-time model, its fit
  to measured runs and the crossover bandwidths;
* :mod:`~hvd_compress.tools.runtools`: the plumbing the example scripts share
  (flags, progress display, the ``--json`` run summary);
* :mod:`~hvd_compress.tools.datasets`: the data the examples train on (digits,
  CIFAR-10 batches) as numpy arrays.

An installed package also carries a copy of the example scripts
(``torch_examples/``, ``tf_examples/``) under ``hvd_compress/tools/examples/``
for ``hvd-compress-compare`` to launch; their source is the repository's
top-level folders of the same names.
"""
