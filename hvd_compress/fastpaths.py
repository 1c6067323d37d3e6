"""Compatibility: the host fast paths live in :mod:`hvd_compress.accel` (registered
against each algorithm's class, :mod:`hvd_compress.accel.host`)."""

from .accel.host import host_decoder, host_encoder, requested
from .accel.host_levels import start_table

__all__ = ["requested", "host_encoder", "host_decoder", "start_table"]
