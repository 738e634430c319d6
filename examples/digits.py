"""Data-parallel training of an MLP on scikit-learn's handwritten digits (real data, no download).

    disttrain run --nproc 4 examples/digits.py        # 4 processes, gloo on CPU
    torchrun --nproc_per_node 4 examples/digits.py    # the same, under torchrun
    python examples/digits.py                         # the same script, alone

Reads top to bottom in the order it runs: config, processes, data, model, training loop,
evaluation. Every rank holds a full replica of the model; each step, each rank computes
gradients on its global_batch_size // world_size samples and `disttrain.DataParallel`
averages them by allreduce during backward, so all replicas stay identical and the run
follows the same trajectory as one process with the whole global batch.
`--zero 1|2|3` uses `disttrain.Zero` instead (ZeRO, Rajbhandari et al. 2019): the same
trajectory, with optimizer state (1), gradients (2) and parameters (3) sharded over ranks.
`--precision bf16|fp16` trains in mixed precision through `disttrain.Zero` (any --zero,
0 included): a bf16/fp16 model and fp32 master weights; fp16 scales the loss.
The last line, printed by rank 0, is `final test accuracy: 0.9xxx`.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler
from torch import nn
from tqdm import tqdm

import disttrain

# -----------------------------------------------------------------------------
# config
parser = argparse.ArgumentParser(description="Data-parallel MLP on the digits data set.")
parser.add_argument("--epochs", type=int, default=10)
parser.add_argument("--global-batch-size", type=int, default=64,
                    help="samples per step over all ranks; must divide by the world size")
parser.add_argument("--lr", type=float, default=2e-3)
parser.add_argument("--hidden", type=int, default=128, help="width of the two hidden layers")
parser.add_argument("--seed", type=int, default=0, help="model init and data order")
parser.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3],
                    help="ZeRO stage: 0 plain data parallel; 1 shards optimizer state, "
                         "2 also gradients, 3 also parameters")
parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"],
                    help="bf16/fp16: low-precision model and gradients, fp32 master weights "
                         "in the optimizer (ZeRO mixed precision; fp16 adds loss scaling)")
args = parser.parse_args()
SPLIT_SEED = 0  # fixed, so that runs with different --seed share one test set

# -----------------------------------------------------------------------------
# processes: the torchrun environment, or a world of one
disttrain.init()
rank, world_size, device = disttrain.rank(), disttrain.world_size(), disttrain.device()
torch.manual_seed(args.seed)  # the same init everywhere (DataParallel broadcasts rank 0's too)

# -----------------------------------------------------------------------------
# data: 1797 8x8 grey-level images (pixels 0..16), 10 classes
digits = load_digits()
x_train, x_test, y_train, y_test = train_test_split(
    digits.data, digits.target, test_size=0.2, random_state=SPLIT_SEED, stratify=digits.target
)
scaler = StandardScaler().fit(x_train)  # statistics of the training split only
x_train = torch.tensor(scaler.transform(x_train), dtype=torch.float32)  # (1437, 64)
x_test = torch.tensor(scaler.transform(x_test), dtype=torch.float32)  # (360, 64)
y_train, y_test = torch.tensor(y_train), torch.tensor(y_test)
train_set = torch.utils.data.TensorDataset(x_train, y_train)
# each rank sees its own 1/world_size of every global batch; the epoch advances by itself
loader = disttrain.data.shard_loader(train_set, args.global_batch_size, seed=args.seed)

# -----------------------------------------------------------------------------
# model
mlp = nn.Sequential(
    nn.Linear(64, args.hidden), nn.ReLU(),
    nn.Linear(args.hidden, args.hidden), nn.ReLU(),
    nn.Linear(args.hidden, 10),
)
if args.zero == 0 and args.precision == "fp32":  # every rank holds the whole model and optimizer
    model = disttrain.DataParallel(mlp.to(device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
else:  # ZeRO: each rank keeps 1/world_size of the optimizer state (and grads, params)
    model = disttrain.Zero(mlp.to(device), lambda ps: torch.optim.AdamW(
        ps, lr=args.lr, weight_decay=1e-4), stage=args.zero, precision=args.precision)
    optimizer = model.optimizer  # steps this rank's shard, then shares the result

# -----------------------------------------------------------------------------
# training loop
bar = tqdm(total=args.epochs * len(loader), disable=rank != 0, unit="step", desc="train")
for _ in range(args.epochs):
    for x, y in loader:
        x, y = x.to(device), y.to(device)  # (B/world, 64), (B/world,)
        loss = F.cross_entropy(model(x).float(), y)  # mean over this rank's samples (fp32)
        optimizer.zero_grad(set_to_none=True)
        if isinstance(model, disttrain.Zero):
            model.backward(loss)  # loss.backward(), times the loss scale in fp16
        else:
            loss.backward()  # gradients are averaged over ranks while backward runs
        optimizer.step()  # identical update on every rank
        bar.set_postfix(epoch=loader.epoch, loss=f"{loss.item():.3f}", refresh=False)
        bar.update()
bar.close()

# -----------------------------------------------------------------------------
# evaluation: each rank scores a disjoint slice of the test set, then the counts are summed
# NOTE: a plain slice, not DistributedSampler, whose padding would count samples twice.
model.eval()
with torch.no_grad():
    x, y = x_test[rank::world_size].to(device), y_test[rank::world_size].to(device)
    correct = (model(x).argmax(dim=1) == y).sum()
counts = torch.stack([correct, torch.tensor(len(y), device=device)]).to(torch.float64)
dist.all_reduce(counts)  # (2,) = [correct, total] over all ranks
disttrain.print0(f"final test accuracy: {(counts[0] / counts[1]).item():.4f}")
disttrain.shutdown()
