"""`ZeroOptimizer`: this rank's optimizer over its ZeRO shards, behind torch.optim's interface.

One step (Rajbhandari et al. 2019, arXiv 1910.02054; mixed precision as mixed.py says):
wait for the engine's gradient reductions and average them (in the parameters' dtype,
so whoever clips `engine.shard_parameters()` gradients, as parallelize does, clips what
is stepped), (mixed) move them into the fp32 masters, unscaled, and (fp16) vote on
overflow, step the inner torch optimizer (or skip it), (mixed) cast the masters down,
and (stages 1-2) all-gather the updated parameters.

Who talks to whom: api.Zero builds it and hands it a `ShardLayout` (the engine, the
masters, the groups; never the module or Zero itself, so ownership points one way); it
drives the engine (flat.py / stage3.py), the masters and loss scaler (mixed.py) and
checkpoint.py; collectives go through comm.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from disttrain.dtypes import accumulation_dtype, scale_, sum_of_squares
from disttrain.parallel.zero import checkpoint as ckpt
from disttrain.parallel.zero import comm, mixed

__all__ = ["ShardLayout", "ZeroOptimizer", "state_tensors", "vote_overflow"]


@dataclass
class ShardLayout:
    """What a ZeroOptimizer steps and over which groups, as Zero built it."""

    engine: Any
    """FlatShards (stages 0-2) or ParamShards (stage 3): shards, gradients, reductions."""
    masters: mixed.MasterWeights | None
    """fp32 master copies of the shards (mixed precision), else None."""
    stage: int
    rank: int
    """This rank's index in `group`."""
    world: int
    """Size of `group` (the dp group the shards are spread over)."""
    precision: str
    group: Any
    overflow_group: Any
    """Where fp16's overflow vote runs (the dp group, or the whole job under parallelize)."""
    comm_stats: comm.CommStats
    state_names: dict[int, str]
    """id(param) -> the name its optimizer state is saved under (tied weights: the first)."""


class ZeroOptimizer:
    """This rank's optimizer over its shards (see the module docstring).

    `step()` blocks (reductions, the overflow vote, the all-gather). In fp16 call
    `backward(loss)` instead of `loss.backward()` (it scales the loss); a step whose
    gradients overflowed on any rank is skipped on every rank (`last_step_skipped`) and
    the scale backs off. `state_dict()` holds only this rank's shard of the state (stage
    >= 1), tagged with the layout, and `load_state_dict` refuses a state saved with
    another layout; `disttrain.Checkpointer` uses `sharded_state_dict()` instead, which
    reshards. LR schedulers attach to `.inner` (the real torch optimizer).
    """

    def __init__(self, layout: ShardLayout, inner: torch.optim.Optimizer,
                 scaler: mixed.LossScaler | None = None):
        self.layout, self.inner, self.scaler = layout, inner, scaler
        self._prepared = False  # reductions waited for, gradients averaged
        self._on_masters = False  # mixed: gradients moved into the fp32 masters
        self._found_inf = False  # fp16: some rank's gradient overflowed this step
        self._voted = False  # fp16: the overflow vote of this step is done
        self._scaled = False  # fp16: the loss was scaled since the last step
        self.last_step_skipped = False

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    @property
    def loss_scale(self) -> float:
        """The loss scale backward() applies (1.0 unless fp16)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` times the loss scale (fp16; else `loss` itself), for a backward that
        someone else runs (torch.amp's `scaler.scale(loss)`). Does not block."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError("scale_loss/backward take the scalar loss tensor, e.g. "
                             "model.optimizer.backward(loss_fn(model(x), y))")
        if self.scaler is not None and loss.dtype == torch.float16:
            raise ValueError("compute the fp16 model's loss in fp32, e.g. "
                             "loss_fn(out.float(), y): the gradient of an fp16 loss is the "
                             f"loss scale itself ({self.scaler.scale:g}), and fp16 overflows "
                             "above 65504")
        self._scaled = True
        return loss * self.scaler.scale if self.scaler is not None else loss

    @property
    def loss_scaled(self) -> bool:
        """Whether this step's loss was scaled (scale_loss/backward/mark_scaled) yet."""
        return self._scaled

    def mark_scaled(self) -> None:
        """Say that this step's backward ran from a loss scaled by `loss_scale` that was
        computed elsewhere (another pipeline stage; parallelize calls it). No comm."""
        self._scaled = True

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of `loss` times the loss scale (fp16), else of `loss` (DeepSpeed's
        engine.backward). Blocks until backward is done (stages 0-1: and reduced)."""
        self.scale_loss(loss).backward()

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.inner.param_groups for p in g["params"]]

    def prepare(self) -> None:
        """Once per step: wait for reductions, sums -> means (in the parameters' dtype).
        Blocks (the reductions still in flight); later calls in the same step do nothing."""
        if self._prepared:
            return
        o = self.layout
        o.engine.prepare_step()
        if self.scaler is not None and not self._scaled and any(
                g is not None for g in o.engine.shard_grads()):
            raise RuntimeError("precision='fp16' needs loss scaling: call "
                               "model.optimizer.backward(loss) (or model.backward(loss), or "
                               "backward of model.optimizer.scale_loss(loss)) instead of "
                               "loss.backward()")
        self._prepared = True

    def _to_masters(self, vote: bool = True) -> None:
        """Mixed precision, once per step: fp32 master gradients = shard gradients / scale,
        and (fp16, `vote`) the overflow vote over the owner's overflow group. Blocks
        (fp16: one all-reduce)."""
        o = self.layout
        if o.masters is not None and not self._on_masters:
            o.masters.to_master(o.engine.shard_grads(), self.loss_scale)
            self._on_masters = True
        if vote and self.scaler is not None and not self._voted:
            self._found_inf = o.masters.found_inf(o.overflow_group, o.comm_stats)
            self._voted = True

    def voted_overflow(self) -> bool | None:
        """This step's fp16 overflow vote once taken (True: some rank overflowed), else None."""
        return self._found_inf if self._voted else None

    def unvoted_masters(self) -> None:
        """Prepare and fill the fp32 master gradients without the overflow vote, for one
        vote over several optimizers (`vote_overflow`). Blocks (waits for reductions)."""
        self.prepare()
        self._to_masters(vote=False)

    def take_vote(self, found: bool) -> None:
        """Record the overflow vote `vote_overflow` took for this step."""
        self._found_inf, self._voted = found, True

    def grads_to_step(self) -> list[torch.Tensor | None]:
        """The gradients step() applies, one per shard parameter: the fp32 masters'
        (unscaled) in mixed precision, else the shards'. Call after backward; blocks
        (waits for reductions, averages; fp16: the overflow vote)."""
        self.prepare()
        self._to_masters()
        if self.layout.masters is not None:
            return [m.grad for m in self.layout.masters.masters]
        return self.layout.engine.shard_grads()

    def step(self, closure=None):
        if closure is not None:
            raise ValueError("ZeroOptimizer.step does not take a closure; "
                             "compute the loss and call backward() before step()")
        self.prepare()
        self._to_masters()
        o = self.layout
        skip = self._found_inf
        if not skip:
            self.inner.step()
            if o.masters is not None:
                o.masters.copy_down()
        if self.scaler is not None:
            self.scaler.update(skip)
        if o.masters is not None:
            o.masters.drop_grads()  # NOTE: the fp32 gradient lives only inside a step
        if not skip:
            o.engine.after_step()
        self.last_step_skipped = skip
        self._reset()

    def _reset(self) -> None:
        self._prepared = self._on_masters = self._found_inf = self._scaled = False
        self._voted = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.layout.engine.zero_grad()
        if self.layout.masters is not None:
            self.layout.masters.drop_grads()
        self._reset()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale gradients so their global L2 norm is at most `max_norm`; returns the norm
        before clipping (in mixed precision: of the unscaled fp32 master gradients; inf
        when this fp16 step overflowed and will be skipped), summed in the gradients'
        dtype (float64 stays float64; fp16/bf16 in fp32). Call after backward, before
        step(); blocks (one tiny all-reduce at stages 1-3, where each rank holds its shard)."""
        self.prepare()
        self._to_masters()
        if self._found_inf:
            return torch.tensor(float("inf"))
        params = self._params()
        # NOTE: the dtype comes from the shard parameters (masters: fp32), the same on
        # every rank of the all-reduce; a rank may hold no gradient at all
        grads = [p.grad for p in params if p.grad is not None]
        sq = sum_of_squares(grads, accumulation_dtype(*(p.dtype for p in params)),
                            params[0].device if params else None)
        if self.layout.stage > 0:
            comm.all_reduce(sq, self.layout.group, self.layout.comm_stats)
        norm = sq.sqrt()
        scale_(grads, (max_norm / (norm + 1e-6)).clamp(max=1.0))
        return norm

    def _layout(self) -> dict[str, Any]:
        o = self.layout
        shards = [int(p.numel()) for p in o.engine.shard_parameters()]
        return {"stage": o.stage, "world_size": o.world, "rank": o.rank, "shard_numels": shards,
                "precision": o.precision}

    def state_dict(self) -> dict[str, Any]:
        out = {"zero": self._layout(), "inner": self.inner.state_dict()}
        if self.layout.masters is not None:
            out["master"] = [m.detach() for m in self.layout.masters.masters]
        if self.scaler is not None:
            out["loss_scaler"] = self.scaler.state_dict()
        return out

    def sharded_state_dict(self) -> dict[str, Any]:
        """Optimizer state as per-parameter `ShardedTensor` pieces (+ fp32 masters and the
        loss scaler), for `disttrain.Checkpointer` (loads at any world size or stage)."""
        o = self.layout
        masters = o.masters.masters if o.masters is not None else None
        tree = ckpt.sharded_state(self.inner, self._params_by_shard(), o.engine.segments(),
                                  o.state_names, masters)
        if self.scaler is not None:
            tree["loss_scaler"] = self.scaler.state_dict()
        return tree

    def _params_by_shard(self) -> list[torch.Tensor]:
        o = self.layout
        return o.masters.masters if o.masters is not None else o.engine.shard_parameters()

    def load_sharded_state_dict(self, tree: dict[str, Any]) -> None:
        """After the checkpointer filled the pieces in place: hyperparameters, scalars,
        the loss scaler; (mixed) parameters <- masters (blocks at stages 1-2: all-gather)."""
        o = self.layout
        ckpt.load_sharded_state(self.inner, self._params_by_shard(), o.engine.segments(),
                                o.state_names, tree)
        self._load_mixed(tree)

    def _load_mixed(self, tree: dict[str, Any]) -> None:
        o = self.layout
        if self.scaler is not None:
            if "loss_scaler" not in tree:
                raise ValueError("this optimizer state has no loss scaler: it was saved "
                                 "without precision='fp16'; load it with the precision it "
                                 "was saved with")
            self.scaler.load_state_dict(tree["loss_scaler"])
        if o.masters is not None:
            o.masters.copy_down()
            o.engine.after_step()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "zero" not in state_dict or "inner" not in state_dict:
            raise ValueError("not a ZeroOptimizer state dict (keys 'zero' and 'inner' expected); "
                             "load a plain optimizer's state into .inner only if unsharded")
        saved, here = dict(state_dict["zero"]), self._layout()
        saved.setdefault("precision", "fp32")
        if saved != here:
            diff = {k: (saved.get(k), v) for k, v in here.items() if saved.get(k) != v}
            raise ValueError(f"optimizer state was saved with a different ZeRO layout "
                             f"(saved, here): {diff}; load it with the same stage, world size, "
                             "precision and model on the same rank")
        self.inner.load_state_dict(state_dict["inner"])
        if self.layout.masters is not None:
            with torch.no_grad():
                for m, v in zip(self.layout.masters.masters, state_dict["master"]):
                    m.copy_(v)
        self._load_mixed(state_dict)


def vote_overflow(optimizers: list[ZeroOptimizer]) -> bool:
    """One fp16 overflow vote for several ZeroOptimizers of this rank (the chunks of an
    interleaved pipeline stage), over the first one's overflow group; every optimizer
    then skips or steps alike. Returns the decision. Blocks (one all-reduce).

    NOTE: one vote per step on every rank of the overflow group, however many chunks a
    rank holds, so the collectives match and every rank's loss scale moves alike."""
    fp16 = [o for o in optimizers if o.scaler is not None]
    votes = [o.voted_overflow() for o in fp16]
    if None not in votes:
        return any(votes)
    for o in optimizers:
        o.unvoted_masters()
    first = fp16[0].layout
    found = mixed.vote(any(o.layout.masters.local_inf() for o in fp16), first.overflow_group,
                       first.comm_stats, first.masters.masters[0].device)
    for o in fp16:
        o.take_vote(found)
    return found


def state_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
