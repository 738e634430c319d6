"""Train an unmodified Hugging Face GPT-2 (a small one, built from a config: no download)
on Python's own source code, in any hybrid layout.

The model is `transformers.GPT2LMHeadModel` as the library ships it: parallelize cuts it
into pipeline stages from its traced graph, shards it with the ready GPT-2 tensor-parallel
plan, and train_step passes the targets to it as `labels=` and reads its `.loss`.

    python examples/hf_gpt2.py                                    # 1 process
    disttrain run --nproc 4 examples/hf_gpt2.py --pp 2 --dp 2
    disttrain run --nproc 2 examples/hf_gpt2.py --tp 2
    disttrain run --nproc 2 examples/hf_gpt2.py --dp 2 --zero 3
    disttrain run --nproc 8 examples/hf_gpt2.py --pp 2 --dp 2 --tp 2 --recompute

Needs `pip install transformers` (in the dev extra).
"""

from __future__ import annotations

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import disttrain
from disttrain.models.text import batches, encode, stdlib_text


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (cut by tracing)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel shards (gpt2 plan)")
    p.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3])
    p.add_argument("--recompute", action="store_true", help="recompute each block in backward")
    p.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved", "zb-h1"])
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=8, help="per dp replica")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    disttrain.init()
    mesh = disttrain.Mesh(pp=args.pp, dp=args.dp, tp=args.tp)
    cfg = GPT2Config(vocab_size=128, n_positions=args.block_size, n_embd=64, n_layer=4,
                     n_head=4, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(args.seed)  # NOTE: every rank builds the same full model first
    model = GPT2LMHeadModel(cfg).to(disttrain.device())
    data = encode(stdlib_text())  # (N,) ASCII codes
    gen = torch.Generator().manual_seed(args.seed + 1000 * mesh.local_rank("dp"))
    loader = batches(data, args.batch_size, args.block_size, gen)
    x, _ = next(loader)  # (B, T): the shapes the traced pipeline is built for
    config = disttrain.Parallelism(
        schedule=args.schedule, microbatches=args.microbatches, zero=args.zero,
        num_virtual=2 if args.schedule == "interleaved" else 1, example=(x, x),
        recompute=[f"transformer.h.{i}" for i in range(cfg.n_layer)] if args.recompute else False,
        optimizer_factory=lambda ps: torch.optim.AdamW(ps, lr=args.lr))
    model = disttrain.parallelize(model, mesh, "auto" if args.tp > 1 else None, config)
    opt = model.optimizer
    first = None
    for step in range(1, args.steps + 1):
        x, _ = (t.to(disttrain.device()) for t in next(loader))
        opt.zero_grad(set_to_none=True)
        # NOTE: GPT-2 shifts its labels itself, so the targets are the inputs
        loss = model.train_step(x, x).item()
        model.clip_grad_norm_(1.0)
        opt.step()
        disttrain.log(loss=loss, tokens=x.numel())  # the trace's metrics (--trace): tokens/s
        first = loss if first is None else first
        if step == 1 or step % 10 == 0:
            disttrain.print0(f"step {step:4d}  loss {loss:.3f}")
    disttrain.print0(f"loss {first:.3f} -> {loss:.3f}")


if __name__ == "__main__":
    main()
