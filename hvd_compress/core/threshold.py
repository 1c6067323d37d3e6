"""2-bit threshold quantization (Strom, Interspeech 2015; MXNet's ``2bit``): its codec.

Fields (``n`` values): ``scale float32[1]`` (= tau), then ``codes`` of 2 bits per
value (0 -> 0, 1 -> +tau, 2 -> -tau).
"""

from __future__ import annotations

from .bitpack import Segment, pack_codes, unpack_values
from .codec import Codec, _flagged, _ternary_table


class ThresholdCodec(Codec):
    """2-bit threshold quantization (Strom, Interspeech 2015; MXNet's ``2bit``).

    Values ``>= tau`` are sent as ``+tau``, values ``<= -tau`` as ``-tau``, the
    rest as 0; with error feedback the remainder stays in the residual.
    """

    name = "threshold"

    @property
    def tau(self) -> float:
        return float(self.params["tau"])

    def layout(self, n, cols=1):
        return [Segment("scale", "float32", 1), Segment("codes", "uint8", -(-n * 2 // 8))]

    def encode_values(self, B, v, flag, noise, cols=1):
        tau = self.tau
        code = B.iadd(B.cast(v >= tau, "uint8"), B.imul(B.cast(v <= -tau, "uint8"), 2))
        scale = B.reshape(_flagged(B.scalar(tau, like=v), flag), (1,))
        return {"scale": scale, "codes": pack_codes(B, code, 2)}

    def decode_values(self, B, fields, n, cols=1):
        # the four code values times the scale, then one look-up per byte
        return unpack_values(B, fields["codes"], 2, n, _ternary_table(B, fields["scale"]))
