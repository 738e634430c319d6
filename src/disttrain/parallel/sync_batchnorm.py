"""BatchNorm whose batch statistics span the data-parallel group (CPU and GPU).

Plain BatchNorm under data parallelism normalizes each replica's batch on its own (dp
"ghost" batches). `SyncBatchNorm` computes the statistics of the whole global batch, as
torch's `nn.SyncBatchNorm` does (which refuses CPU tensors): forward all-reduces each
channel's (sum, sum of squares, count), backward each channel's (sum dy, sum dy * xhat),
so every replica holds the same running statistics and, with equal local batches, DP
(or ZeRO) over the group equals one process on the global batch (tests/dist/
test_resnet.py). Math and buffer policy: docs/design/model-parallelism.md, "BatchNorm".

Who talks to whom: `convert_sync_batchnorm` / `Parallelism(sync_batchnorm=True)` swap it
in; one blocking all-reduce over `group` per forward and one per backward (comm/ops.py,
so a hang names it). Every rank of the group must run the same forward and backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from disttrain.comm import ops

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm"]


def _dims(x: torch.Tensor) -> list[int]:
    return [d for d in range(x.dim()) if d != 1]  # every dim but the channels


class _SyncBatchNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, group):  # x (N, C, ...)
        dims = _dims(x)
        count = torch.full((1,), x.numel() // x.shape[1], dtype=x.dtype, device=x.device)
        stats = torch.cat([x.sum(dims), (x * x).sum(dims), count])  # (2C + 1,)
        ops.all_reduce(stats, group=group)  # blocks
        c = x.shape[1]
        n = stats[-1]
        mean = stats[:c] / n
        var = (stats[c:2 * c] / n - mean * mean).clamp(min=0)  # biased, as BatchNorm uses
        invstd = (var + eps).rsqrt()
        shape = [1, c] + [1] * (x.dim() - 2)
        xhat = (x - mean.view(shape)) * invstd.view(shape)
        ctx.save_for_backward(xhat, invstd, weight, n)
        ctx.group, ctx.shape = group, shape
        y = xhat * weight.view(shape) if weight is not None else xhat
        y = y + bias.view(shape) if bias is not None else y
        ctx.mark_non_differentiable(mean, var, n)
        return y, mean, var, n

    @staticmethod
    def backward(ctx, dy, _mean, _var, _n):
        xhat, invstd, weight, n = ctx.saved_tensors
        dims, shape, c = _dims(dy), ctx.shape, dy.shape[1]
        local = torch.cat([dy.sum(dims), (dy * xhat).sum(dims)])  # (2C,)
        grad_w = local[c:].clone() if weight is not None else None
        grad_b = local[:c].clone()
        ops.all_reduce(local, group=ctx.group)  # blocks: sums over the global batch
        mean_dy, mean_dy_xhat = (local[:c] / n).view(shape), (local[c:] / n).view(shape)
        scale = invstd * weight if weight is not None else invstd
        dx = scale.view(shape) * (dy - mean_dy - xhat * mean_dy_xhat)
        return dx, grad_w, grad_b, None, None


class SyncBatchNorm(_BatchNorm):
    """BatchNorm over the whole batch of `group` (None: the world) in training mode;
    plain BatchNorm with the running statistics in eval mode. Any input (N, C, ...)."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True, group=None,
                 device=None, dtype=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         device=device, dtype=dtype)
        self.group = group

    def _check_input_dim(self, x):
        if x.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects (N, C, ...) input, got {x.dim()}D")

    def forward(self, x):
        self._check_input_dim(x)
        use_batch = self.training or not self.track_running_stats
        if not use_batch or not dist.is_initialized() or dist.get_world_size(self.group) == 1:
            return super().forward(x)
        y, mean, var, n = _SyncBatchNormFn.apply(x, self.weight, self.bias, self.eps, self.group)
        if self.training and self.track_running_stats:
            self._update_running(mean.detach(), var.detach(), n)
        return y

    @torch.no_grad()
    def _update_running(self, mean, var, n) -> None:
        """As BatchNorm: momentum (or, with momentum=None, the cumulative average), the
        running variance unbiased over the global count."""
        self.num_batches_tracked.add_(1)
        m = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        unbiased = var * (n / (n - 1)) if n > 1 else var
        self.running_mean.mul_(1 - m).add_(mean.to(self.running_mean.dtype), alpha=m)
        self.running_var.mul_(1 - m).add_(unbiased.to(self.running_var.dtype), alpha=m)


def convert_sync_batchnorm(module: nn.Module, group=None) -> nn.Module:
    """Replace every BatchNorm1d/2d/3d in `module` by a `SyncBatchNorm` over `group`
    (None: the world), keeping its Parameter and buffer objects (same names, same values),
    as torch's `nn.SyncBatchNorm.convert_sync_batchnorm`. Returns the module (a new one
    when `module` itself is a BatchNorm). Call it before DataParallel, Zero or parallelize;
    under parallelize pass the mesh's dp group: `convert_sync_batchnorm(m, mesh.group("dp"))`.
    Does not block."""
    if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
        out = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, group)
        if module.affine:
            out.weight, out.bias = module.weight, module.bias
        if module.track_running_stats:
            out.running_mean, out.running_var = module.running_mean, module.running_var
            out.num_batches_tracked = module.num_batches_tracked
        out.training = module.training
        return out
    for name, child in module.named_children():
        new = convert_sync_batchnorm(child, group)
        if new is not child:
            setattr(module, name, new)
    return module

