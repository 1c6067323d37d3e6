"""Every numba kernel of the host fast paths, as one namespace (importing this imports
numba and loads the kernels from numba's disk cache, compiling them the first time).

The kernels live by family -- :mod:`.kernels_signs`, :mod:`.kernels_stochastic`,
:mod:`.kernels_levels`, :mod:`.kernels_select`, :mod:`.kernels_chunks` -- and reach the core only through the
wrappers registered in :mod:`.host`, which import this module on the first fast path
asked for (:func:`.host.numba_kernels`), never with the package.  The wrappers call
the kernels as attributes of this module, so a test may watch one by replacing it here.
"""

from .kernels_chunks import (
                             ef_add_gather,
                             ef_count,
                             ef_onebit_pack,
                             ef_sign_sums,
                             onebit_sum,
                             seg_copy,
                             seg_dgc_pack,
                             seg_dgc_thresholds,
                             seg_nonfinite,
                             seg_onebit_decode,
                             seg_onebit_pack,
                             seg_sign_sums,
                             seg_topk_decode,
                             seg_topk_pack,
                             topk_sum,
)
from .kernels_levels import (
                             bucket_codes,
                             bucket_decode,
                             bucket_minmax,
                             eightbit_codes,
                             lookup_scaled,
                             lookup_subtract,
                             natural_codes,
                             natural_decode,
                             uniform_codes,
)
from .kernels_select import (
                             add_count,
                             at_least,
                             count_at_least,
                             dgc_momentum,
                             dgc_sample,
                             inceptionn_decode,
                             inceptionn_pack,
                             inceptionn_widths,
                             top_counts,
                             top_select,
)
from .kernels_signs import (
                             abs_sum,
                             bit_decode,
                             bit_decode_columns,
                             column_sign_sums,
                             lookup_2bit,
                             onebit_pack,
                             onebit_pack_columns,
                             sign_sums,
                             signum_step,
                             threshold_pack,
)
from .kernels_stochastic import (
                             bucket_sumsq,
                             intsum_lanes,
                             intsum_words,
                             moments,
                             qsgd_codes,
                             seg_stratified,
                             stratified,
                             terngrad_pack,
)

__all__ = ["threshold_pack", "onebit_pack", "sign_sums", "column_sign_sums", "onebit_pack_columns",
           "bit_decode_columns", "moments", "terngrad_pack", "qsgd_codes", "bucket_sumsq",
           "bucket_decode", "abs_sum", "natural_codes", "natural_decode", "lookup_2bit",
           "bit_decode", "signum_step", "bucket_minmax", "uniform_codes", "eightbit_codes",
           "lookup_scaled", "bucket_codes", "lookup_subtract", "top_counts", "top_select",
           "dgc_momentum", "dgc_sample", "stratified", "count_at_least", "at_least", "add_count",
           "inceptionn_widths", "inceptionn_pack", "inceptionn_decode", "intsum_words",
           "intsum_lanes", "seg_sign_sums", "seg_onebit_pack", "onebit_sum", "seg_onebit_decode",
           "seg_nonfinite", "seg_topk_pack", "topk_sum", "seg_topk_decode",
           "seg_copy", "ef_sign_sums", "ef_onebit_pack", "seg_dgc_thresholds", "seg_dgc_pack",
           "seg_stratified", "ef_count", "ef_add_gather"]
