"""Execute a pipeline schedule: this stage's F/B(/W) actions with point-to-point send/recv.

Who talks to whom: `Pipeline.step` runs this stage's list from schedules.py. Stage s
receives activations from the owner of the previous virtual stage and sends its outputs
to the owner of the next (chunk c of stage s is virtual stage c*p + s); gradients flow
the other way. Sends are `isend`s waited at the end of the step; every message is tagged
(micro-batch, virtual stage, kind), so two stages may exchange both kinds in any order.
The first step sends a shape header per edge; later steps send bare tensors, so stage
output shapes must stay the same (a change raises). A schedule with W actions (ZB-H1)
calls split_backward.py for B and W; ZeRO 3 and recompute are refused there.

Each action's compute span is recorded (measured bubbles, for disttrain.trace too) and
saved-for-backward bytes are counted (peak memory). Details: docs/design/
model-parallelism.md, "Pipeline".
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from disttrain.comm import ops
from disttrain.dtypes import upcast_half
from disttrain.parallel.pipeline.schedules import Action
from disttrain.parallel.pipeline.split_backward import (
    backward_input,
    backward_weight,
    check_split_backward,
)
from disttrain.trace import events as trace_events

__all__ = ["Pipeline", "Span"]

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32]
_HEADER = 8  # dtype code, ndim, up to 6 dims


@dataclass
class Span:
    """One executed action: seconds since the step started (pp-group barrier)."""

    kind: str
    microbatch: int
    chunk: int
    start: float
    end: float


@dataclass
class _Meter:
    """Bytes of tensors currently saved for backward, and the peak of that."""

    now: int = 0
    peak: int = 0

    def add(self, n: int) -> None:
        self.now += n
        self.peak = max(self.peak, self.now)


class _Saved:
    """A tensor saved for backward, counted from its save until backward first uses it.

    NOTE: counted down on unpack, not on deletion: a saved *output* forms a reference
    cycle with its grad_fn through this object, so deletion waits for the garbage
    collector and would overstate what is alive.
    """

    __slots__ = ("tensor", "meter", "nbytes")

    def __init__(self, tensor, meter):
        self.tensor, self.meter = tensor, meter
        self.nbytes = tensor.numel() * tensor.element_size()
        meter.add(self.nbytes)

    def unpack(self) -> torch.Tensor:
        self.meter.add(-self.nbytes)
        self.nbytes = 0
        return self.tensor


@dataclass
class _Step:
    inputs: list
    targets: list
    stash: dict = field(default_factory=dict)
    pending_w: dict = field(default_factory=dict)  # (mb, chunk) -> (out, grad) kept for W
    posted: dict = field(default_factory=dict)  # (kind, mb, chunk) -> (buffer, recv work)
    sends: list = field(default_factory=list)
    loss: torch.Tensor | None = None


class Pipeline:
    """Runs `actions` (this stage's list) over `chunks` with its peers in `group`.

    chunks: this stage's model chunks (chunk c = virtual stage c * num_stages + stage), or
        `torch.compile(chunk)`s; one with `no_sync()` syncs only on its last backward.
    ranks: global ranks of the pipeline group, by stage.
    loss_fn(output, target): on the last virtual stage; its mean over micro-batches is
        the loss (each micro-batch's loss is divided by num_microbatches).
    tied: this stage's copies of weights tied across stages (tied.py); their gradients
        are summed over their stage group after the step's last backward.
    device: where activations live (default: the first chunk's parameters').
    target_arg: the last virtual stage calls `chunk(x, **{target_arg: y})` (a model that
        computes its own loss) and passes what it returns to loss_fn.
    """

    def __init__(self, chunks: list[nn.Module], actions: list[Action], stage: int,
                 num_stages: int, num_microbatches: int, loss_fn, group=None,
                 ranks: list[int] | None = None, track_memory: bool = False, tied=None,
                 device: torch.device | None = None, target_arg: str | None = None):
        self.tied, self.target_arg = tied, target_arg
        self.chunks, self.actions = list(chunks), list(actions)
        self.stage, self.num_stages, self.num_microbatches = stage, num_stages, num_microbatches
        self.loss_fn, self.group = loss_fn, group
        self.ranks = list(ranks) if ranks is not None else list(range(num_stages))
        self.num_virtual = len(self.chunks)
        used = {a.chunk for a in self.actions}
        if used != set(range(self.num_virtual)):
            raise ValueError(f"stage {stage} got {self.num_virtual} model chunk(s) but its "
                             f"schedule uses chunks {sorted(used)}; give one chunk per virtual stage")
        self.last_virtual = num_stages * self.num_virtual - 1
        self.track_memory = track_memory
        self.steps_done = 0
        self._recv_shapes: dict[int, tuple] = {}  # edge (sending virtual stage) -> (shape, dtype)
        self._sent_shapes: dict[int, tuple] = {}
        # NOTE: a ZeRO stage-3 chunk has no parameter to read the device from: pass it
        first = next(self.chunks[0].parameters(), None)
        self.device = device or (first.device if first is not None else torch.device("cpu"))
        self.meter = _Meter()
        self.spans: list[Span] = []
        self.whole_w = 0  # W actions of the last step that walked the whole graph again
        self.split_backward = any(a.kind == "W" for a in self.actions)
        # NOTE: W of a ZeRO chunk, and DataParallel's synced W, run as one autograd run
        # (their hooks end a step per backward); other W walk only the weight branches
        self._one_run = check_split_backward(self.chunks) if self.split_backward else []
        # NOTE: DataParallel syncs in the chunk's last action that accumulates weight grads
        last = {a.chunk: i for i, a in enumerate(self.actions)
                if a.kind == ("W" if self.split_backward else "B")}
        self._synced_b = set(last.values())

    def step(self, inputs: torch.Tensor | None, targets: torch.Tensor | None) -> torch.Tensor:
        """Forward and backward of one batch over all micro-batches. Blocks.

        `inputs` matter on the first stage and `targets` on the last (others may pass
        None). Gradients accumulate into the chunks' `.grad`. Returns the batch's mean
        loss on every stage, broadcast from the last in its dtype (fp16/bf16: fp32).
        """
        st = _Step(self._split(inputs, "inputs", 0), self._split(targets, "targets",
                                                                   self.last_virtual))
        self.spans, self.meter.peak, self.whole_w = [], self.meter.now, 0
        trace_events.pipeline_begin()  # NOTE: the step's trace opens here, before the barrier
        if self.num_stages > 1:
            ops.barrier(group=self.group)
        t0 = time.perf_counter()
        for i, a in enumerate(self.actions):
            # NOTE: post this action's and the next one's receive before computing, so a
            # peer's send finds its receive waiting (no round trip on the critical path).
            self._post_recv(st, a)
            if i + 1 < len(self.actions):
                self._post_recv(st, self.actions[i + 1])
            if a.kind == "F":
                self._forward(st, a, t0)
            elif a.kind == "W":
                self._weight(st, a, t0, sync=i in self._synced_b)
            else:
                self._backward(st, a, t0, sync=i in self._synced_b)
        for work in st.sends:
            work.wait()
        if self.tied is not None:
            # NOTE: after every backward, so DataParallel has written dp-averaged grads
            self.tied.all_reduce_grads()
        loss = self._share_loss(st.loss)
        assert not st.stash and not st.pending_w, \
            f"pipeline stage {self.stage} left {len(st.stash) + len(st.pending_w)} activations"
        self.steps_done += 1
        trace_events.pipeline_step(self.spans, t0, self.stage)
        return loss

    def _share_loss(self, loss: torch.Tensor | None) -> torch.Tensor:
        """The last stage's loss on every stage, in its dtype (fp16/bf16: fp32). Blocks
        (pp > 1: one broadcast of [loss, dtype code] in float64, which holds any float
        loss exactly, so the stages that compute no loss need not know its dtype)."""
        if self.num_stages == 1:
            return upcast_half(loss.detach().reshape(()))
        msg = torch.zeros(2, dtype=torch.float64, device=self.device)
        if loss is not None:
            msg[0], msg[1] = loss.detach().reshape(()), _DTYPES.index(loss.dtype)
        ops.broadcast(msg, self.ranks[self.last_virtual % self.num_stages], group=self.group)
        return upcast_half(msg[0].to(_DTYPES[int(msg[1])]))

    def _split(self, batch, what: str, virtual: int) -> list:
        if virtual % self.num_stages != self.stage:
            return []
        if batch is None:
            raise ValueError(f"pipeline stage {self.stage} needs {what} (it runs virtual stage {virtual})")
        if batch.shape[0] % self.num_microbatches:
            raise ValueError(f"batch of {batch.shape[0]} does not split into "
                             f"{self.num_microbatches} equal micro-batches; make it a multiple")
        return list(batch.chunk(self.num_microbatches))

    def _virtual(self, a: Action) -> int:
        return a.chunk * self.num_stages + self.stage

    def _peer(self, virtual: int) -> int:
        return self.ranks[virtual % self.num_stages]

    def _tag(self, mb: int, edge: int, kind: int) -> int:
        # edge: the virtual stage the message leaves (act) or arrives at (grad)
        return ((mb * (self.last_virtual + 1) + edge) * 3 + kind)

    def _forward(self, st: _Step, a: Action, t0: float) -> None:
        j = self._virtual(a)
        if j == 0:
            x = st.inputs[a.microbatch]
        else:
            x = self._recv_activation(st, a, j - 1)
        start = time.perf_counter()
        with self._saving():
            last = j == self.last_virtual
            kw = {self.target_arg: st.targets[a.microbatch]} if last and self.target_arg else {}
            out = self.chunks[a.chunk](x, **kw)
            if last:
                out = self.loss_fn(out, st.targets[a.microbatch]) / self.num_microbatches
                st.loss = out.detach() if st.loss is None else st.loss + out.detach()
        self.spans.append(Span("F", a.microbatch, a.chunk, start - t0, time.perf_counter() - t0))
        if j != self.last_virtual:
            self._send_activation(st, out.detach(), self._peer(j + 1), a.microbatch, j)
        st.stash[(a.microbatch, a.chunk)] = (x, out)

    def _backward(self, st: _Step, a: Action, t0: float, sync: bool) -> None:
        j = self._virtual(a)
        x, out = st.stash.pop((a.microbatch, a.chunk))
        grad = self._take(st, a) if j != self.last_virtual else None
        start = time.perf_counter()
        if self.split_backward:  # B: input gradient only; W runs later
            params = [p for p in self.chunks[a.chunk].parameters() if p.requires_grad]
            gx, plan = backward_input(out, x, grad, params)
            st.pending_w[(a.microbatch, a.chunk)] = (out, grad, plan)
            self.spans.append(Span("B", a.microbatch, a.chunk, start - t0, time.perf_counter() - t0))
            if j > 0:
                st.sends.append(ops.isend(gx.contiguous(), self._peer(j - 1), group=self.group,
                                           tag=self._tag(a.microbatch, j - 1, 2)))
            return
        chunk = self.chunks[a.chunk]
        ctx = chunk.no_sync() if (not sync and hasattr(chunk, "no_sync")) else contextlib.nullcontext()
        with ctx:
            torch.autograd.backward(out, grad)
        self.spans.append(Span("B", a.microbatch, a.chunk, start - t0, time.perf_counter() - t0))
        if j > 0:
            st.sends.append(ops.isend(x.grad.contiguous(), self._peer(j - 1), group=self.group,
                                       tag=self._tag(a.microbatch, j - 1, 2)))

    def _weight(self, st: _Step, a: Action, t0: float, sync: bool) -> None:
        """W: weight gradients of a micro-batch whose B ran earlier. Blocks (local)."""
        out, grad, plan = st.pending_w.pop((a.microbatch, a.chunk))
        start = time.perf_counter()
        chunk = self.chunks[a.chunk]
        dp = hasattr(chunk, "no_sync")
        if self._one_run[a.chunk] or (sync and dp):
            plan = None
        self.whole_w += plan is None
        ctx = chunk.no_sync() if (not sync and dp) else contextlib.nullcontext()
        with ctx:
            backward_weight(out, grad, [p for p in chunk.parameters() if p.requires_grad], plan)
        self.spans.append(Span("W", a.microbatch, a.chunk, start - t0, time.perf_counter() - t0))

    def _send_activation(self, st: _Step, y: torch.Tensor, dst: int, mb: int, j: int) -> None:
        if y.dim() > _HEADER - 2 or y.dtype not in _DTYPES:
            raise TypeError(f"pipeline can send tensors of up to {_HEADER - 2} dims of dtypes "
                            f"{_DTYPES}; stage output is {y.dtype} with shape {tuple(y.shape)}")
        if self.steps_done == 0:
            header = torch.zeros(_HEADER, dtype=torch.int64, device=y.device)
            header[0], header[1] = _DTYPES.index(y.dtype), y.dim()
            header[2:2 + y.dim()] = torch.tensor(y.shape, dtype=torch.int64)
            st.sends.append(ops.isend(header, dst, group=self.group, tag=self._tag(mb, j, 0)))
            self._sent_shapes[j] = (tuple(y.shape), y.dtype)
        elif self._sent_shapes[j] != (tuple(y.shape), y.dtype):
            raise ValueError(
                f"pipeline stage {self.stage}: output of virtual stage {j} is {y.dtype} "
                f"{tuple(y.shape)}, but was {self._sent_shapes[j][1]} {self._sent_shapes[j][0]} "
                "in the first step; keep batch and sequence sizes fixed across steps")
        y = y.contiguous()
        st.sends.append(ops.isend(y, dst, group=self.group, tag=self._tag(mb, j, 1)))

    def _post_recv(self, st: _Step, a: Action) -> None:
        """Post (not wait for) the receive `a` needs: an activation header or a gradient."""
        key, j = (a.kind, a.microbatch, a.chunk), self._virtual(a)
        if key in st.posted:
            return
        if a.kind == "F" and j > 0:
            src = self._peer(j - 1)
            if self.steps_done > 0:  # the tensor itself, its shape learned in step one
                shape, dtype = self._recv_shapes[j - 1]
                buf, tag = torch.empty(shape, dtype=dtype, device=self.device), \
                    self._tag(a.microbatch, j - 1, 1)
            else:  # first step: its shape header
                buf, tag = torch.empty(_HEADER, dtype=torch.int64, device=self.device), \
                    self._tag(a.microbatch, j - 1, 0)
        elif a.kind == "B" and j != self.last_virtual and (a.microbatch, a.chunk) in st.stash:
            buf, src, tag = torch.empty_like(st.stash[(a.microbatch, a.chunk)][1]), \
                self._peer(j + 1), self._tag(a.microbatch, j, 2)
        else:
            return
        st.posted[key] = (buf, ops.irecv(buf, src, group=self.group, tag=tag))

    def _take(self, st: _Step, a: Action) -> torch.Tensor:
        """Wait for the receive posted for `a` and return its buffer. Blocks."""
        self._post_recv(st, a)
        buf, work = st.posted.pop((a.kind, a.microbatch, a.chunk))
        work.wait()
        return buf

    def _recv_activation(self, st: _Step, a: Action, j: int) -> torch.Tensor:
        """The activation virtual stage `j` sent for `a`'s micro-batch. Blocks."""
        x = self._take(st, a)
        if self.steps_done == 0:  # x is the header: now receive the tensor
            dtype, ndim = _DTYPES[int(x[0])], int(x[1])
            shape = tuple(x[2:2 + ndim].tolist())
            self._recv_shapes[j] = (shape, dtype)
            x = torch.empty(shape, dtype=dtype, device=self.device)
            ops.recv(x, self._peer(j), group=self.group, tag=self._tag(a.microbatch, j, 1))
        return x.requires_grad_(x.is_floating_point())

    @contextlib.contextmanager
    def _saving(self):
        if not self.track_memory:
            yield
            return
        meter = self.meter

        def pack(t):  # weights (and views of them, e.g. w.t()) are not activations
            is_weight = isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)
            return t if is_weight else _Saved(t, meter)

        def unpack(o):
            return o.unpack() if isinstance(o, _Saved) else o

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield

    @property
    def peak_activation_bytes(self) -> int:
        """Peak bytes saved for backward during the last step (with track_memory=True)."""
        return self.meter.peak

