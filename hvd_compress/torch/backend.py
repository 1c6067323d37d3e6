"""The core's array backend on torch tensors, on whatever device they live.

Every method mirrors :class:`hvd_compress.core.backend.NumpyBackend` and gives
the same bits (``tests/test_torch_same_bits.py`` checks it).  New tensors go to
the device of ``like`` (the tensor being compressed); nothing here copies data
to the host or waits for the device, except :meth:`to_numpy` (checkpoints and
tests) and the CPU-only fast paths, where there is no device to wait for.
"""

from __future__ import annotations

import numpy as np
import torch

from ..accel.device import device_decoder, device_encoder, device_powersgd, device_top_indices, device_unpack
from ..core.backend import (
    fill_uniform,
    host_chunk_paths,
    host_fast_decoders,
    host_fast_paths,
    selection_sample,
)
from ..core.layout import OUT_FIRST

_DTYPES = {
    "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
    "float64": torch.float64, "uint8": torch.uint8, "int32": torch.int32, "int64": torch.int64,
    "int16": torch.int16,
    # bfloat16 bit patterns travel as int16 (same bits as the reference's uint16)
    "uint16": torch.int16, "bool": torch.bool,
}
_NAMES = {v: k for k, v in _DTYPES.items() if k != "uint16"}
_NAMES[torch.int16] = "uint16"


def _np_dtype(t):
    return {torch.float32: np.float32, torch.float64: np.float64}.get(t.dtype, np.float64)


def _dev(like):
    return like.device if isinstance(like, torch.Tensor) else None


def _on_device(dev) -> bool:
    return dev is not None and dev.type != "cpu"


def _filled(value, dtype, dev):
    """A 0-d tensor of the number ``value`` on ``dev`` by ``torch.full``, which, unlike
    ``torch.tensor`` of a number, does not wait for the device (pytorch#120996); a float
    past the dtype's range gives inf as ``torch.tensor`` does (``torch.full`` raises)."""
    if dtype.is_floating_point and abs(float(value)) > torch.finfo(dtype).max:
        with np.errstate(over="ignore"):  # IEEE rounding: inf, or the largest if it rounds so
            cast = {torch.float16: np.float16, torch.float32: np.float32}.get(dtype)
            value = float(cast(value)) if cast else float(np.copysign(np.inf, float(value)))
    return torch.full((), value, dtype=dtype, device=dev)


class TorchBackend:
    """Backend on torch tensors (CPU or CUDA)."""

    name = "torch"
    #: weights are stored out-channels first, ``(out, in)``, ``(cout, cin, kh, kw)`` (core.layout)
    layout = OUT_FIRST

    # -- dtypes and construction -------------------------------------------
    def dtype_name(self, x) -> str:
        return _NAMES[x.dtype]

    def shape(self, x) -> tuple:
        return tuple(x.shape)

    def asarray(self, x, dtype=None, like=None):
        if isinstance(x, torch.Tensor):
            return x if dtype is None else x.to(_DTYPES[dtype])
        return torch.as_tensor(x, dtype=_DTYPES[dtype] if dtype else None, device=_dev(like))

    def cast(self, x, dtype: str):
        if dtype == "uint8" and x.dtype == torch.bool:
            return x.view(torch.uint8)  # 0/1 bytes: a view, no copy
        if dtype == "uint16" and x.dtype == torch.bfloat16:
            return x.view(torch.int16)
        return x.to(_DTYPES[dtype])

    def zeros(self, shape, dtype="float32", like=None):
        return torch.zeros(shape, dtype=_DTYPES[dtype], device=_dev(like))

    def full(self, shape, value, dtype="float32", like=None):
        return torch.full(shape, value, dtype=_DTYPES[dtype], device=_dev(like))

    def arange(self, n, dtype="int64", like=None):
        return torch.arange(n, dtype=_DTYPES[dtype], device=_dev(like))

    def scalar(self, value, dtype="float32", like=None):
        dev = _dev(like)
        if _on_device(dev) and isinstance(value, (int, float, np.generic)):
            return _filled(value, _DTYPES[dtype], dev)  # a number copied to a GPU waits for it
        return torch.tensor(value, dtype=_DTYPES[dtype], device=dev)

    def copy(self, x):
        return x.clone()

    # -- shape ----------------------------------------------------------------
    def reshape(self, x, shape):
        return x.reshape(shape)

    def concat(self, xs):
        return torch.cat([x.reshape(-1) for x in xs])

    def pad_to(self, x, n):
        extra = n - x.shape[0]
        if extra == 0:
            return x
        return torch.cat([x, x.new_zeros(extra)])

    # -- elementwise ----------------------------------------------------------
    def abs(self, x):
        return x.abs()

    def sign(self, x):
        return x.sign()

    def where(self, cond, a, b):
        return torch.where(cond, a, b)

    def cond(self, pred, if_true, if_false):
        if isinstance(pred, bool) or self.is_host(pred):
            return if_true() if bool(pred) else if_false()
        return torch.where(pred, if_true(), if_false())

    def isfinite(self, x):
        return torch.isfinite(x)

    def floor(self, x):
        return x.floor()

    def log(self, x):
        return x.log()

    def cos(self, x):
        return x.cos()

    def sqrt(self, x):
        return x.sqrt()

    def maximum(self, a, b):
        if not isinstance(b, torch.Tensor):
            return a.clamp(min=b)
        return torch.maximum(a, b)

    def minimum(self, a, b):
        if not isinstance(b, torch.Tensor):
            return a.clamp(max=b)
        return torch.minimum(a, b)

    def clip(self, x, lo, hi):
        return torch.clamp(x, lo, hi)

    # -- reductions -------------------------------------------------------------
    def sum(self, x, axis=None):
        return x.sum() if axis is None else x.sum(dim=axis)

    def max(self, x, axis=None):
        return x.max() if axis is None else x.max(dim=axis).values

    def all_finite(self, x):
        if x.numel() == 0:
            return torch.tensor(True, device=x.device)
        lo, hi = torch.aminmax(x)  # NaN and +-Inf propagate: one read-only pass
        return torch.isfinite(lo) & torch.isfinite(hi)

    def absmax(self, x):
        lo, hi = torch.aminmax(x)
        return torch.maximum(lo.abs(), hi.abs())

    def sum64(self, x, axis=None):
        if x.device.type == "cpu":  # numpy's float64 pairwise sum: the reference's bits, faster
            return torch.from_numpy(np.asarray(np.sum(x.detach().numpy(), axis=axis,
                                                      dtype=np.float64)))
        return x.sum(dtype=torch.float64) if axis is None else x.sum(dim=axis, dtype=torch.float64)

    def sumsq64(self, x, axis=None):
        if x.device.type == "cpu":
            from hvd_compress.core.backend import NUMPY
            return torch.from_numpy(np.asarray(NUMPY.sumsq64(x.detach().numpy(), axis=axis)))
        x = x.to(torch.float64)
        return (x * x).sum() if axis is None else (x * x).sum(dim=axis)

    def bucket_sumsq64(self, x, d):
        if x.device.type == "cpu":
            from hvd_compress.core.backend import NUMPY
            return torch.from_numpy(NUMPY.bucket_sumsq64(x.detach().numpy(), d))
        n = x.shape[0]
        xb = self.pad_to(x, -(-n // d) * d).reshape(-1, d).to(torch.float64)
        return (xb * xb).sum(dim=1)

    def bucket_scale(self, x, factors, d):
        n = x.shape[0]
        full = n // d
        if full:
            x[:full * d].view(full, d).mul_(factors[:full, None])
        if n % d:
            x[full * d:].mul_(factors[full])
        return x

    def count_nonzero(self, mask, axis=None):
        return torch.count_nonzero(mask) if axis is None else torch.count_nonzero(mask, dim=axis)

    def cumsum(self, x):
        return torch.cumsum(x, 0)

    def top_indices(self, mag, k):
        # host: the core's selection (nonzero) is the fast one; devices: the Triton radix
        # select where it runs, else the core's (compact)
        return None if self.is_host(mag) else device_top_indices(self, mag, k)

    def fused_encoder(self, codec, cols, like=None):
        """For CPU tensors (``like``), the host fast path the numpy backend has (numba
        kernels, :mod:`hvd_compress.accel.host`, over numpy views); on CUDA devices the
        Triton kernels where triton imports (:mod:`hvd_compress.accel.device`), else None."""
        if like is not None and not self.is_host(like):
            return device_encoder(self, codec, cols, like)
        provider = host_fast_paths()
        return None if provider is None else provider(self, codec, cols)

    def fused_decoder(self, codec, cols, like=None):
        """For CPU tensors, the host decoders (numba); on CUDA devices the Triton ones."""
        if like is not None and not self.is_host(like):
            return device_decoder(self, codec, cols, like)
        provider = host_fast_decoders()
        return None if provider is None else provider(self, codec, cols)

    def chunk_path(self, comp, like=None):
        """For CPU tensors, the host chunk paths of the two-phase exchange (numba); None on
        devices (a chunk a call)."""
        if like is not None and not self.is_host(like):
            return None
        provider = host_chunk_paths()
        return None if provider is None else provider(self, comp)

    def fused_powersgd(self, like):
        """PowerSGD's element-wise passes as one-pass kernels for ``like``'s device (the
        Triton ones, :mod:`hvd_compress.accel.triton_powersgd`), or None: the core's chain
        (host memory, no triton; :meth:`~hvd_compress.core.powersgd.PowerSGD.fused`)."""
        return None if self.is_host(like) else device_powersgd(like)

    def fused_unpack(self, data, bits, n, values, factors=None, d=None, cols=1):
        """On devices, codes of 1, 2 or 4 bits: shifted out of each byte, then one 1-d
        look-up of ``values`` (the chain's 256-row table gather took 2.0-3.9 ms for
        25.6M codes on an H200; a 1-d look-up of as many took 0.1 ms); the same
        float32 values; one Triton kernel instead where it runs.  None elsewhere (host
        memory has its own decoders)."""
        if self.is_host(data) or cols != 1:
            return None
        fast = device_unpack(self, data, bits, n, values, factors, d)
        if fast is not None or bits not in (1, 2, 4):
            return fast
        shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=data.device)
        codes = ((data.to(torch.int32).unsqueeze(1) >> shifts) & ((1 << bits) - 1)).reshape(-1)[:n]
        out = self.asarray(values, "float32", like=data).index_select(0, codes)
        return out if factors is None else self.bucket_scale(out, factors, d)

    def kth_largest(self, x, k):
        n = x.shape[0]
        if not self.is_host(x):
            # topk, not kthvalue, on devices: CUDA's kthvalue selects within one thread
            # block per row (186 ms for 25.6M values on an H200, where topk takes 0.7 ms).
            if 2 * k <= n + 1:
                return torch.topk(x, k, sorted=False).values.min()
            return torch.topk(x, n - k + 1, largest=False, sorted=False).values.max()
        plan = selection_sample(n, k)
        if plan is not None:
            return _kth_largest_sampled(x, k, *plan)
        return torch.kthvalue(x, n - k + 1).values

    # -- indexing -----------------------------------------------------------------
    def gather(self, x, idx):
        return x[idx]

    def scatter_add(self, n, idx, values, dtype="float32"):
        out = torch.zeros(n, dtype=_DTYPES[dtype], device=values.device)
        return out.index_add_(0, idx, values.to(out.dtype))

    def lookup(self, table, idx):
        flat = idx.reshape(-1)
        if flat.dtype not in (torch.int32, torch.int64):
            flat = flat.int()  # uint8 codes index rows (a uint8 index would be a mask)
        return table.index_select(0, flat).reshape(*idx.shape, *table.shape[1:])

    def bucketize(self, x, edges):
        return torch.searchsorted(edges, x, right=True)

    def nonzero(self, mask):
        return torch.nonzero(mask).reshape(-1)

    def sort(self, x):
        return torch.sort(x).values

    def is_host(self, x) -> bool:
        return x.device.type == "cpu"

    def flat_view(self, x):
        return x.view(-1) if x.is_contiguous() else None

    def izero(self, x):
        return x.zero_()

    def icopy(self, x, y):
        return x.copy_(y)

    def iadd(self, x, y):
        return x.add_(y)

    def isub(self, x, y):
        return x.sub_(y)

    def isign(self, x):
        return x.sign_()

    def imul(self, x, y):
        return x.mul_(y)

    def iminimum(self, x, hi):
        return x.clamp_(max=hi)

    def ishr(self, x, s):
        return x.bitwise_right_shift_(s)

    def iand(self, x, y):
        return x.bitwise_and_(y)

    def div(self, a, b):
        # torch computes tensor / scalar (and scalar / tensor) as a multiplication by the
        # reciprocal: one rounding too many.  numpy (CPU) or a full-shape divisor (devices)
        # keeps true, correctly rounded division.
        ref = a if isinstance(a, torch.Tensor) else b
        if ref.device.type == "cpu":
            an = a.detach().numpy() if isinstance(a, torch.Tensor) else np.asarray(a, _np_dtype(ref))
            bn = b.detach().numpy() if isinstance(b, torch.Tensor) else np.asarray(b, _np_dtype(ref))
            return torch.from_numpy(np.asarray(np.true_divide(an, bn)))
        a, b = (_filled(t, ref.dtype, ref.device)  # a number: no H2D wait
                if _on_device(ref.device) and isinstance(t, (int, float, np.generic))
                else torch.as_tensor(t, dtype=ref.dtype, device=ref.device) for t in (a, b))
        shape = torch.broadcast_shapes(a.shape, b.shape)
        return torch.div(a.expand(shape).contiguous(), b.expand(shape).contiguous())

    def idiv(self, x, y):
        if x.device.type == "cpu":
            yn = y.detach().numpy() if isinstance(y, torch.Tensor) else y
            np.true_divide(x.detach().numpy(), yn, out=x.detach().numpy())
            return x
        y = (_filled(y, x.dtype, x.device) if isinstance(y, (int, float, np.generic))  # no H2D wait
             else torch.as_tensor(y, dtype=x.dtype, device=x.device))
        return x.div_(y.expand(x.shape).contiguous())

    def ifloor(self, x):
        return x.floor_()

    def index_add(self, acc, idx, values):
        return acc.index_add_(0, idx, values.to(acc.dtype))

    def iscale_at(self, x, idx, factor: float):
        return x.index_put_((idx,), x[idx].mul_(factor))  # repeats write equal products

    def compact(self, mask, k):
        n = mask.shape[0]
        if self.is_host(mask):  # no device to wait for: the direct way is fastest
            idx = torch.nonzero(mask).reshape(-1)[:k]
            if idx.shape[0] < k:
                idx = torch.cat([idx, idx.new_full((k - idx.shape[0],), n)])
            return idx
        # Static shapes, no host round-trip: the j-th True entry is where the running
        # count first reaches j (a search per slot; n where the count never does).  A
        # scatter of every position to its rank sent the n - k others to one spare slot.
        counts = torch.cumsum(mask, 0)
        return torch.searchsorted(counts, torch.arange(1, k + 1, device=mask.device))

    # -- integers and bits ----------------------------------------------------------
    def shift_left(self, x, s):
        return torch.bitwise_left_shift(x, s)

    def shift_right(self, x, s):
        return torch.bitwise_right_shift(x, s)

    def bit_and(self, x, y):
        return torch.bitwise_and(x, y)

    def bit_or(self, x, y):
        return torch.bitwise_or(x, y)

    def bit_xor(self, x, y):
        return torch.bitwise_xor(x, y)

    def mul_low32(self, x, c):
        # int64 products wrap modulo 2**64; the low 32 bits are exact.
        return torch.bitwise_and(x * c, 0xFFFFFFFF)

    def bitcast(self, x, dtype):
        target = _DTYPES[dtype]
        x = x.contiguous()
        size = torch.empty((), dtype=target).element_size()
        if x.storage_offset() * x.element_size() % size:
            x = x.clone()  # views need aligned storage offsets
        return x.view(target)

    def to_bfloat16_bits(self, x):
        # torch rounds float32 -> bfloat16 to nearest even, like the reference.
        return x.to(torch.bfloat16).view(torch.int16)

    def from_bfloat16_bits(self, bits):
        if bits.dtype == torch.int16:
            bits = bits.view(torch.bfloat16)
        # bfloat16, or float16 when the sum travelled as float16 (see Compressor.wire)
        return bits.to(torch.float32)

    # -- linear algebra -------------------------------------------------------------
    def matmul(self, a, b, transpose_a=False, transpose_b=False):
        rhs = b.t() if transpose_b else b  # BLAS takes a transposed thin operand as it is
        if transpose_a:
            # a^T rhs as (rhs^T a)^T: a is then read by rows.  Transposing a first took
            # 102 ms on a 5055x5055 matrix here, a^T as an operand 58, this 10.
            return (rhs.t() @ a).t().contiguous()
        return a @ rhs

    def subtract_product(self, c, a, b):
        # c - a b^T in one BLAS call (78 -> 45 ms on 5055x5055: no product matrix made)
        return torch.addmm(c, a, b.t(), alpha=-1)

    def transpose(self, x):
        return x.t().contiguous()

    def orthonormalize(self, p):
        q, r = torch.linalg.qr(p)
        d = torch.sign(torch.diagonal(r))
        d = torch.where(d == 0, torch.ones_like(d), d)
        return q * d

    # -- random numbers ------------------------------------------------------------------
    def generator(self, seed):
        return _LazyGenerator(seed)

    def uniform(self, gen, n, like=None):
        return gen.uniform(n, _dev(like))

    def random_key(self, gen, like=None):
        """A uniform 64-bit integer from the generator for ``like``'s device (host fast
        paths: CPU tensors, numpy's generator, as the numpy backend draws it)."""
        g = gen.get(_dev(like))
        if isinstance(g, np.random.Generator):
            return int(g.integers(0, (1 << 64) - 1, dtype=np.uint64, endpoint=True))
        return int(torch.randint(-(1 << 63), (1 << 63) - 1, (1,), generator=g, device=g.device,
                                 dtype=torch.int64).item()) & ((1 << 64) - 1)

    def generator_state(self, gen):
        return gen.state()

    def set_generator_state(self, gen, state):
        gen.load(state)

    # -- devices and host conversion ------------------------------------------------------
    def to_numpy(self, x):
        if x.dtype == torch.bfloat16:
            x = x.view(torch.int16)
        return x.detach().cpu().numpy()

    def from_numpy(self, a, like=None):
        a = np.asarray(a)
        if a.dtype == np.uint16:
            a = a.view(np.int16)
        return torch.from_numpy(np.array(a, copy=True)).to(_dev(like) or "cpu")

    def host_view(self, x):
        return x.detach().numpy()  # CPU tensors only (the host fast paths)

    def from_host(self, a):
        return torch.from_numpy(a)

    def align(self, value, like):
        """``value`` moved to ``like``'s device if it is elsewhere (restored state)."""
        if isinstance(value, torch.Tensor) and isinstance(like, torch.Tensor) \
                and value.device != like.device:
            return value.to(like.device)
        return value

    def synchronize(self):
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()


def _kth_largest_sampled(x, k, stride, want):
    """Exact k-th largest of a large CPU vector: a threshold from a sample
    (:func:`~hvd_compress.core.backend.selection_sample`), one pass to keep the
    candidates above it, the exact answer among those; widen if too few."""
    n = x.shape[0]
    sample = x[::stride]
    m = sample.shape[0]
    while True:
        t = torch.kthvalue(sample, m - want + 1).values
        cand = x[x >= t]
        if cand.shape[0] >= k:
            return torch.kthvalue(cand, cand.shape[0] - k + 1).values
        if want >= m:  # the sample cannot go lower: exact on everything
            return torch.kthvalue(x, n - k + 1).values
        want = min(m, want * 4)


class _LazyGenerator:
    """The compressor's own generator, made for the device of the first tensor it serves:
    numpy's PCG64 for CPU tensors (faster than torch's CPU generator; the draws are
    written straight into a torch tensor), a ``torch.Generator`` on CUDA devices."""

    def __init__(self, seed):
        self.seed = seed
        self.gen = None
        self._pending = None

    def get(self, device):
        device = torch.device(device or "cpu")
        if self.gen is None or getattr(self.gen, "device", torch.device("cpu")) != device:
            if device.type == "cpu":
                self.gen = np.random.Generator(np.random.PCG64(self.seed))
            else:
                self.gen = torch.Generator(device=device)
                self.gen.manual_seed(self.seed)
            if self._pending is not None:
                self._load(self._pending)
                self._pending = None
        return self.gen

    def uniform(self, n, device):
        g = self.get(device)
        if isinstance(g, np.random.Generator):
            # One buffer reused across calls (fresh pages cost as much as the draws).
            if getattr(self, "_buf", None) is None or self._buf.numel() != n:
                self._buf = torch.empty(n, dtype=torch.float32)
            fill_uniform(g, self._buf.numpy())
            return self._buf
        return torch.rand(n, generator=g, device=g.device, dtype=torch.float32)

    def state(self):
        if self.gen is None:  # not drawn from yet: a loaded state still waits to be applied
            return dict(self._pending) if self._pending is not None else {"seed": self.seed,
                                                                          "kind": None}
        if isinstance(self.gen, np.random.Generator):
            return {"seed": self.seed, "kind": "numpy", "state": self.gen.bit_generator.state}
        return {"seed": self.seed, "kind": "torch", "device": str(self.gen.device),
                "state": self.gen.get_state().numpy().tobytes()}

    def _load(self, state):
        if state.get("kind") == "numpy" and isinstance(self.gen, np.random.Generator):
            self.gen.bit_generator.state = state["state"]
        elif state.get("kind") == "torch" and isinstance(self.gen, torch.Generator):
            self.gen.set_state(torch.frombuffer(bytearray(state["state"]), dtype=torch.uint8))

    def load(self, state):
        self.seed = state["seed"]
        self.gen = None
        self._pending = state if state.get("kind") else None
