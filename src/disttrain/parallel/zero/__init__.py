"""ZeRO: data parallelism with sharded optimizer state, gradients and parameters.

Rajbhandari et al. 2019, arXiv 1910.02054. `api.py` is the user-facing wrapper,
`flat.py` stages 0-2, `stage3.py` stage 3, `comm.py` the counted collectives.
"""

from disttrain.parallel.zero.api import Zero, ZeroOptimizer
from disttrain.parallel.zero.comm import CommStats

__all__ = ["CommStats", "Zero", "ZeroOptimizer"]
