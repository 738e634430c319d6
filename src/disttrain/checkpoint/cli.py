"""`disttrain checkpoint inspect|convert`: look into a checkpoint, or consolidate it, offline.

inspect DIR   prints the step, who saved it, every file with its size and whether its
              SHA-256 matches, every tensor with dtype, global shape and how it is cut,
              and the saved state (model / optimizer / extra / loader position). DIR is
              a checkpoint folder or the Checkpointer's folder (then every checkpoint is
              listed and the one `load` would pick is shown). Exit 1 if a file is damaged.
convert DIR --to OUT [--pieces N --dim D]
              reassembles every tensor whole into a one-file checkpoint at OUT (a
              Checkpointer folder that any layout loads; with --pieces N, each tensor
              cut into N pieces along D, one file each), or, when OUT ends with
              `.safetensors`, writes only the model's weights as a plain safetensors file
              with the model's own keys (for tools that know nothing of disttrain).

Registered in disttrain/cli.py as `add_checkpoint_parser`; runs without processes.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from typing import Any

import safetensors.torch

from disttrain.checkpoint import io
from disttrain.checkpoint.manifest import (
    MANIFEST,
    CheckpointError,
    CorruptCheckpointError,
    Manifest,
    Piece,
    TensorEntry,
    dtype_from_name,
)
from disttrain.checkpoint.reshard import Slice, assemble, even_slice
from disttrain.checkpoint.state import leaves

__all__ = ["add_checkpoint_parser", "main"]


def add_checkpoint_parser(subparsers) -> None:
    p = subparsers.add_parser("checkpoint", help="inspect or convert a disttrain checkpoint",
                              description=__doc__.split("\n\n")[1],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(title="actions", metavar="ACTION")
    ins = sub.add_parser("inspect", help="print what a checkpoint holds and verify checksums")
    ins.add_argument("dir", help="a checkpoint folder (step_XXXXXXXX) or the Checkpointer folder")
    ins.add_argument("--json", action="store_true", help="print the manifest's tables as JSON")
    ins.set_defaults(handler=_inspect)
    conv = sub.add_parser("convert", help="reassemble every tensor into a one-file checkpoint")
    conv.add_argument("dir", help="a checkpoint folder or the Checkpointer folder")
    conv.add_argument("--to", required=True, dest="out",
                      help="output Checkpointer folder, or FILE.safetensors for model weights only")
    conv.add_argument("--pieces", type=int, default=1,
                      help="cut every tensor into N pieces along --dim, one file each "
                           "(default 1: one file; any layout loads either)")
    conv.add_argument("--dim", type=int, default=0, help="dimension to cut along (default 0)")
    conv.set_defaults(handler=_convert)
    p.set_defaults(handler=lambda args: (p.print_help(), 2)[1])


def _resolve(path: str) -> tuple[str, list[str]]:
    """(checkpoint folder, every checkpoint name when given the Checkpointer folder)."""
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return path, []
    names = io.checkpoint_dirs(path)
    if not names:
        raise CheckpointError(f"{path} holds no checkpoint (no {MANIFEST}, no step_* folders)")
    return os.path.join(path, names[0]), names


def _verify(folder: str, m: Manifest) -> dict[str, str]:
    status = {}
    for name, entry in m.files.items():
        try:
            io.read_verified(folder, name, entry)
            status[name] = "ok"
        except CorruptCheckpointError as err:
            status[name] = f"DAMAGED: {err}"
    return status


def _friendly(handler):
    """Turn a checkpoint or file error into one line on stderr and exit code 1."""

    @functools.wraps(handler)
    def run(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except (CheckpointError, OSError) as err:
            print(f"disttrain checkpoint: error: {err}", file=sys.stderr)
            return 1

    return run


@_friendly
def _inspect(args: argparse.Namespace) -> int:
    folder, names = _resolve(args.dir)
    latest = io.read_latest(args.dir) if names else None
    for name in names:
        mark = "  <- latest" if name == latest else ""
        print(f"{name}{mark}")
    m = Manifest.read(folder)
    status = _verify(folder, m)
    if args.json:
        print(json.dumps({"step": m.step, "world_size": m.world_size, "files": m.files,
                          "checksums": status, "tensors": {
                              k: {"dtype": e.dtype, "global_shape": list(e.global_shape),
                                  "layout": e.layout()} for k, e in m.tensors.items()}},
                         indent=1))
    else:
        _print_report(folder, m, status)
    return 0 if all(s == "ok" for s in status.values()) else 1


def _print_report(folder: str, m: Manifest, status: dict[str, str]) -> None:
    print(f"checkpoint {folder}: step {m.step}, saved by {m.world_size} rank(s)")
    print(f"files ({len(m.files)}):")
    for name, entry in m.files.items():
        print(f"  {name:<24} {entry['bytes']:>12,} B  sha256 {entry['sha256'][:16]}  "
              f"{status[name]}")
    print(f"tensors ({len(m.tensors)}):")
    width = max((len(k) for k in m.tensors), default=4)
    for name, e in m.tensors.items():
        print(f"  {name:<{width}}  {e.dtype:<9} {str(list(e.global_shape)):<14} {e.layout()}")
    for key, tree in m.trees.items():
        n = len(list(leaves(tree)))
        groups = tree.get("param_groups") if isinstance(tree, dict) else None
        more = f", {len(groups)} param group(s)" if isinstance(groups, list) else ""
        if key == "extra" and isinstance(tree, dict):
            more += f", keys {sorted(tree)}"
        print(f"state {key}: {n} tensor(s){more}")
    positions = [r.get("loader") for r in m.ranks]
    if any(p is not None for p in positions):
        print(f"loader position (rank 0): {json.dumps(positions[0])}")
    bad = [n for n, s in status.items() if s != "ok"]
    print("checksums: all ok" if not bad else f"checksums: {len(bad)} file(s) DAMAGED: {bad}")


def _whole(folder: str, m: Manifest, name: str, cache: dict):
    e = m.tensors[name]

    def read(i: int):
        file = e.pieces[i].file
        if file not in cache:
            cache[file] = io.read_verified(folder, file, m.files[file])
        return cache[file][name]

    want = Slice((0,) * len(e.global_shape), e.global_shape)
    return assemble(name, want, [p.slice for p in e.pieces], read, dtype_from_name(e.dtype))


@_friendly
def _convert(args: argparse.Namespace) -> int:
    if args.pieces < 1 or args.dim < 0:
        raise CheckpointError(f"--pieces must be >= 1 and --dim >= 0, got {args.pieces}, "
                              f"{args.dim}")
    folder, _ = _resolve(args.dir)
    m = Manifest.read(folder)
    cache: dict = {}
    tensors = {name: _whole(folder, m, name, cache) for name in m.tensors}
    if args.out.endswith(".safetensors"):
        weights = {k.removeprefix("model/"): t for k, t in tensors.items()
                   if k.startswith("model/")}
        if not weights:
            raise CheckpointError(f"{folder} holds no model state to export")
        safetensors.torch.save_file(weights, args.out)
        print(f"wrote {len(weights)} model tensors to {args.out}")
        return 0
    out_folder = os.path.join(args.out, io.step_dir_name(m.step))
    os.makedirs(out_folder, exist_ok=False)
    files: dict[str, dict[str, Any]] = {}
    for name, t in tensors.items():
        pieces = _cut(t, args.pieces, args.dim)
        m.tensors[name] = TensorEntry(m.tensors[name].dtype, tuple(t.shape), [
            Piece(f"rank{r:05d}.safetensors", piece) for r, piece in pieces])
        for r, piece in pieces:
            files.setdefault(f"rank{r:05d}.safetensors", {})[name] = t[piece.index()]
    m.files = {f: io.write_tensors(os.path.join(out_folder, f), held)
               for f, held in sorted(files.items())}
    io.write_durable(os.path.join(out_folder, MANIFEST), m.to_json().encode())
    io.write_latest(args.out, io.step_dir_name(m.step))
    print(f"wrote {out_folder}: {len(tensors)} tensors in {len(m.files)} file(s)")
    return 0


def _cut(t, pieces: int, dim: int) -> list[tuple[int, Slice]]:
    """(file index, slice) pieces of `t`: `pieces` along `dim` when it has that dim."""
    whole = [(0, Slice((0,) * t.dim(), tuple(t.shape)))]
    if pieces == 1 or t.dim() <= dim:
        return whole
    cut = [(r, even_slice(t.shape, r, pieces, dim)) for r in range(pieces)]
    return [(r, s) for r, s in cut if s.numel] or whole


def main(argv: list[str] | None = None) -> int:
    """`python -m disttrain.checkpoint.cli inspect DIR` (same as `disttrain checkpoint`)."""
    parser = argparse.ArgumentParser(prog="disttrain")
    add_checkpoint_parser(parser.add_subparsers())
    args = parser.parse_args(["checkpoint", *(sys.argv[1:] if argv is None else argv)])
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
