"""ZeRO: data parallelism with sharded optimizer state, gradients and parameters.

Rajbhandari et al. 2019, arXiv 1910.02054. `api.py` is the user-facing wrapper,
`optimizer.py` its optimizer, `flat.py` stages 0-2, `stage3.py` stage 3, `comm.py` the
counted collectives, `mixed.py` mixed precision (fp32 masters, loss scaler),
`groups.py` per-parameter optimizer groups, `checkpoint.py` resharding state.
"""

from disttrain.parallel.zero.api import Zero
from disttrain.parallel.zero.comm import CommStats
from disttrain.parallel.zero.mixed import LossScaler
from disttrain.parallel.zero.optimizer import ZeroOptimizer

__all__ = ["CommStats", "LossScaler", "Zero", "ZeroOptimizer"]
