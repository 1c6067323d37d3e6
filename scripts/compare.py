#!/usr/bin/env python
"""Compressors over worker counts and bandwidths with real Horovod runs (see hvd_compress/tools/compare.py).

    python scripts/compare.py --out results            # same as: hvd-compress-compare --out results
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hvd_compress.tools.compare import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
