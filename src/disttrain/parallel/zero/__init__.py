"""ZeRO: data parallelism with sharded optimizer state, gradients and parameters.

Rajbhandari et al. 2019, arXiv 1910.02054. `api.py` is the user-facing wrapper,
`optimizer.py` its optimizer, `flat.py` stages 0-2, `stage3.py` stage 3, `comm.py` the
counted collectives, `mixed.py` mixed precision (fp32 masters, loss scaler),
`groups.py` per-parameter optimizer groups, `checkpoint.py` resharding state.
"""

from disttrain.deprecation import moved
from disttrain.parallel.zero.api import Zero
from disttrain.parallel.zero.mixed import LossScaler
from disttrain.parallel.zero.optimizer import ZeroOptimizer

__all__ = ["LossScaler", "Zero", "ZeroOptimizer"]

# NOTE: deprecated for one release: ZeRO's byte counters are its own (`Zero.comm_stats`).
__getattr__ = moved(__name__, {"CommStats": "disttrain.parallel.zero.comm:CommStats"})
