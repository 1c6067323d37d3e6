"""A tensor's matrix view, which follows its framework's storage layout.

PowerSGD factors a gradient as a matrix and 1-bit SGD keeps a pair of means per
matrix column (Seide et al. 2014: one per input feature of the ``out x in``
weight matrix).  Which axis of a tensor holds the output channels is the
framework's convention, so the backend declares it (``B.layout``):

* :data:`OUT_FIRST` -- PyTorch, and the numpy reference by default: a dense weight
  is ``(out, in)``, a conv kernel ``(cout, cin, kh, kw)``; the matrix is
  ``(shape[0], numel / shape[0])``, as PyTorch's PowerSGD hook reshapes it.
* :data:`OUT_LAST` -- TensorFlow / Keras: a dense kernel is ``(in, out)``, a conv
  kernel ``(kh, kw, cin, cout)``; the matrix is ``(numel / shape[-1], shape[-1])``,
  the transpose of the former (up to the order of the input axes).

With the view taken from the right end, a 3x3 kernel is a ``9 cin x cout``
matrix in TensorFlow, not a 3-row one, so both frameworks send the same number
of bytes for the same model.  Vectors are ``(numel, 1)`` in either layout.
"""

from __future__ import annotations

OUT_FIRST = "out_first"
OUT_LAST = "out_last"
LAYOUTS = (OUT_FIRST, OUT_LAST)


def check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}: expected one of {', '.join(LAYOUTS)}")
    return layout


def matrix_shape(shape, layout: str = OUT_FIRST) -> tuple:
    """``(rows, cols)`` of the matrix the flat (row-major) values of a tensor of ``shape``
    make in ``layout``: ``(out, in)`` for :data:`OUT_FIRST`, ``(in, out)`` for
    :data:`OUT_LAST`; ``(numel, 1)`` for fewer than two axes."""
    numel = 1
    for d in shape:
        numel *= d
    if len(shape) < 2:
        return (numel, 1)
    if check_layout(layout) == OUT_LAST:
        return (numel // shape[-1], shape[-1])
    return (shape[0], numel // shape[0])


def input_features(shape, layout: str = OUT_FIRST) -> int:
    """The number of input features (the ``in`` of an ``out x in`` weight) of a tensor of
    ``shape`` in ``layout``: 1 for fewer than two axes."""
    rows, cols = matrix_shape(shape, layout)
    if len(shape) < 2:
        return 1
    return rows if layout == OUT_LAST else cols


def to_out_first(B, v, shape, layout: str):
    """Flat values of a tensor of ``shape`` stored in ``layout``, in the order of its
    :data:`OUT_FIRST` ``(out, in)`` matrix (a transpose for :data:`OUT_LAST`, else ``v``)."""
    if layout != OUT_LAST or len(shape) < 2:
        return v
    return B.reshape(B.transpose(B.reshape(v, matrix_shape(shape, layout))), (-1,))


def from_out_first(B, v, shape, layout: str):
    """The inverse of :func:`to_out_first`: flat values back in ``layout``'s order."""
    if layout != OUT_LAST or len(shape) < 2:
        return v
    rows, cols = matrix_shape(shape, layout)
    return B.reshape(B.transpose(B.reshape(v, (cols, rows))), (-1,))


def layout_of(B) -> str:
    """The layout backend ``B`` declares (``B.layout``); :data:`OUT_FIRST` if it declares none."""
    return check_layout(getattr(B, "layout", OUT_FIRST))


def column_shape(k: int, layout: str = OUT_FIRST) -> tuple:
    """The shape in ``layout`` of a matrix of ``k`` outputs and one input feature: ``(k, 1)``
    out-first, ``(1, k)`` out-last (a vector that still counts as a matrix, as the
    hierarchical exchange's shards do: one 1-bit column, and the same bits either way)."""
    return (1, k) if check_layout(layout) == OUT_LAST else (k, 1)
