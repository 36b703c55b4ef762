"""Peak RSS of this process during a block, for tests that bound a load's memory: the
benchmarks' sampler (``benchmarks/common.py``), one implementation for both."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "benchmarks"))

from common import peak_rss_sampler  # noqa: E402

__all__ = ["peak_rss_sampler"]
