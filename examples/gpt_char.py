"""Train a small character-level GPT on Python's own source code, in any hybrid layout.

The text is the standard library's source (textwrap.py, string.py, ...), read from the
running Python: no download. The same script runs alone or under a launcher:

    python examples/gpt_char.py                                   # 1 process
    disttrain run --nproc 2 examples/gpt_char.py --tp 2
    disttrain run --nproc 4 examples/gpt_char.py --pp 2 --dp 2 --schedule gpipe
    disttrain run --nproc 8 examples/gpt_char.py --pp 2 --dp 2 --tp 2 --microbatches 4
    disttrain run --nproc 4 examples/gpt_char.py --dp 2 --tp 2 --zero 2  # ZeRO over dp
    disttrain run --nproc 4 examples/gpt_char.py --pp 2 --tp 2 --tie --recompute
    disttrain run --nproc 4 examples/gpt_char.py --dp 2 --tp 2 --sequence-parallel
    disttrain run --nproc 2 examples/gpt_char.py --dp 2 --zero 2 --precision bf16
    disttrain run --nproc 4 examples/gpt_char.py --pp 2 --dp 2 --zero 2 --precision fp16 --tie

It prints the loss going down and, at the end, a sample of generated text.
"""

from __future__ import annotations

import argparse
import time

import torch

import disttrain
from disttrain.models import GPT, GPTConfig
from disttrain.models.text import batches, decode, encode, stdlib_text


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pp", type=int, default=1, help="pipeline stages")
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel shards per layer")
    p.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved", "zb-h1"])
    p.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3],
                   help="0: DataParallel over dp; 1-3: ZeRO stage over dp (optimizer state, "
                        "+ gradients, + parameters sharded)")
    p.add_argument("--algorithm", default="native",
                   choices=["native", "ring", "halving-doubling", "tree", "hierarchical", "auto"],
                   help="how dp gradients are all-reduced (docs/cluster.md; ZeRO 1-2: native or ring)")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"],
                   help="with --zero: bf16/fp16 model and gradients, fp32 master weights in "
                        "the optimizer; fp16 scales the loss (dynamic; every stage and tp "
                        "rank skips an overflowed step together)")
    p.add_argument("--tie", action="store_true",
                   help="tie the token embedding and the LM head (one copy per pipeline stage)")
    p.add_argument("--recompute", action="store_true",
                   help="recompute each transformer block's activations in backward")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="with --tp > 1: split LayerNorm/residual activations along the "
                        "sequence over tp (Megatron); --block-size must divide by --tp")
    p.add_argument("--microbatches", type=int, default=2, help="micro-batches per step")
    p.add_argument("--virtual", type=int, default=2, help="chunks per stage (interleaved only)")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch-size", type=int, default=16, help="sequences per dp replica")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--clip", type=float, default=1.0, help="max gradient norm (0: no clipping)")
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--sample-chars", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    disttrain.init()
    mesh = disttrain.Mesh(pp=args.pp, dp=args.dp, tp=args.tp)
    disttrain.print0(f"mesh pp={args.pp} dp={args.dp} tp={args.tp}, schedule {args.schedule}, "
                     f"{args.microbatches} micro-batches, zero {args.zero}")

    data = encode(stdlib_text())  # (N,) ASCII codes
    cfg = GPTConfig(vocab_size=128, block_size=args.block_size, n_layer=args.n_layer,
                    n_head=args.n_head, n_embd=args.n_embd, tie_embeddings=args.tie)
    torch.manual_seed(args.seed)  # NOTE: every rank builds the same full model first
    model = GPT(cfg).to(disttrain.device())
    disttrain.print0(f"{len(data):,} characters of stdlib source; "
                     f"{sum(p.numel() for p in model.parameters()):,} parameters")
    virtual = args.virtual if args.schedule == "interleaved" else 1
    mixed, loss_fn = args.precision != "fp32", None
    if mixed and not args.zero:
        raise SystemExit("--precision bf16/fp16 trains through ZeRO: add --zero 1, 2 or 3")
    if mixed:  # the loss in fp32; with fp16, parallelize scales it (and unscales the result)
        base = disttrain.token_loss(mesh.group("tp") if args.tp > 1 else None)
        loss_fn = lambda out, y: base(out.float(), y)  # noqa: E731
    # NOTE: parallelize builds the optimizer: with ZeRO it holds only this rank's dp shard
    config = disttrain.Parallelism(
        schedule=args.schedule, microbatches=args.microbatches, num_virtual=virtual,
        zero=args.zero, algorithm=args.algorithm, precision=args.precision, recompute=args.recompute, loss_fn=loss_fn,
        sequence_parallel=args.sequence_parallel,
        optimizer_factory=lambda ps: torch.optim.AdamW(ps, lr=args.lr))
    model = disttrain.parallelize(model, mesh, GPT.tp_plan, config)
    opt = model.optimizer

    # every rank of one dp replica (its pp stages and tp shards) reads the same batches
    gen = torch.Generator().manual_seed(args.seed + 1000 * mesh.local_rank("dp"))
    loader = batches(data, args.batch_size, args.block_size, gen)
    t0, first = time.perf_counter(), None
    for step in range(1, args.steps + 1):
        x, y = (t.to(disttrain.device()) for t in next(loader))  # (B, T) each
        opt.zero_grad(set_to_none=True)
        loss = model.train_step(x, y).item()  # fp16: parallelize scaled the loss; unscaled
        if args.clip > 0:  # the whole model's norm over every shard (fp16: unscaled masters)
            model.clip_grad_norm_(args.clip)
        opt.step()
        disttrain.log(loss=loss, tokens=x.numel())  # the trace's metrics (--trace): tokens/s
        first = loss if first is None else first
        if step == 1 or step % args.log_every == 0 or step == args.steps:
            rate = step * args.batch_size * args.dp * args.block_size / (time.perf_counter() - t0)
            disttrain.print0(f"step {step:4d}  loss {loss:.3f}  ({rate:,.0f} tokens/s)")
    disttrain.print0(f"loss {first:.3f} -> {loss:.3f}")

    state = model.full_state_dict()  # collective: the whole model lands on rank 0
    if disttrain.rank() == 0:
        full = GPT(cfg)
        full.load_state_dict(state)
        prompt = encode("def ")[None]  # (1, 4)
        out = full.generate(prompt, args.sample_chars, generator=torch.Generator().manual_seed(0))
        print("--- sample ---\n" + decode(out[0]) + "\n--------------", flush=True)
    disttrain.shutdown()


if __name__ == "__main__":
    main()
