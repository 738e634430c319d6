"""What `disttrain plan layout` prints: the ranked table and `--explain`'s breakdown.

Throughput per device is counted as Narayanan et al. 2021 count it (eq. 3: 96 B s l h^2
(1 + s/6h + V/16lh) FLOPs per step with full recompute, 72 without), so it compares with
their teraFLOP/s; MFU is the model's FLOPs (72, recompute not counted) over peak.
"""

from __future__ import annotations

from disttrain.plan.cost import DTYPE, Estimate
from disttrain.plan.devices import Device
from disttrain.plan.gpt import NARAYANAN, GPTSpec

__all__ = ["table", "explain", "throughput", "mfu", "days"]


def throughput(m: GPTSpec, e: Estimate, n: int, batch: int) -> float:
    """FLOP/s per device, Narayanan's count (recompute's extra forward included)."""
    flops = m.model_flops(batch * m.seq) * (4 / 3 if e.layout.recompute else 1)
    return flops / (n * e.step)


def mfu(m: GPTSpec, e: Estimate, dev: Device, n: int, batch: int) -> float:
    return m.model_flops(batch * m.seq) / (n * e.step * dev.per_rank(n).peak_flops[DTYPE])


def days(m: GPTSpec, e: Estimate, batch: int, tokens: float) -> float:
    return tokens / (batch * m.seq) * e.step / 86400


def _row(i, m, dev, n, batch, e: Estimate, tokens) -> str:
    lay = e.layout
    cells = [f"{i:>2}", f"{lay.pp:>4}", f"{lay.dp:>5}", f"{lay.tp:>3}", f"{lay.zero:>4}",
             f"{lay.micro_batch:>3}", f"{lay.microbatches:>5}", f"{lay.schedule:>11}",
             f"{'on' if lay.recompute else 'off':>4}", f"{'on' if lay.sp else 'off':>4}",
             f"{e.step:>9.4g}", f"{mfu(m, e, dev, n, batch):>6.1%}",
             f"{throughput(m, e, n, batch) / 1e12:>8.4g}", f"{e.memory / 1e9:>8.3g}",
             f"{'yes' if e.fits else 'NO':>4}", f"{e.bubble / e.step:>7.1%}",
             f"{e.wire_bytes / 1e9:>9.4g}"]
    if tokens:
        cells.append(f"{days(m, e, batch, tokens):>8.3g} days")
    return " ".join(cells)


def table(m: GPTSpec, dev: Device, n: int, batch: int, result, tokens: float | None) -> str:
    """The ranked table, fastest first."""
    head = (f"{m.params / 1e9:.4g}B-parameter GPT on {n} x {dev.key}, global batch {batch} "
            f"x {m.seq} tokens; {result.candidates} layouts: {result.visited} priced, "
            f"{result.too_big} do not fit {dev.per_rank(n).usable_bytes / 1e9:.3g} GB, the rest cannot "
            f"beat row {len(result.ranked)}")
    cols = (" #   pp    dp  tp zero  mb     m    schedule   rc   sp   step(s)    MFU  TFLOP/s"
            "  mem(GB) fits  bubble  GB/step")
    if tokens:
        cols += "  training"
    rows = [_row(i + 1, m, dev, n, batch, e, tokens) for i, e in enumerate(result.ranked)]
    note = ("TFLOP/s per device counts recompute's extra forward (Narayanan et al. 2021, eq. 3); "
            "MFU does not. GB/step: bytes one device sends per step.")
    return "\n".join([head, cols, *rows, note])


def _terms(title: str, terms, unit: str) -> list[str]:
    scale = 1e9 if unit == "GB" else 1.0
    lines = [title]
    for t in terms:
        lines.append(f"  {t.name:<42} {t.value / scale:>10.4g} {unit}  = {t.formula}")
        if t.source:
            lines.append(f"  {'':<42} {'':>10}     [{t.source}]")
    return lines


def explain(m: GPTSpec, dev: Device, n: int, batch: int, result) -> str:
    """The winner's breakdown (time, memory, sources) and why the runner-up lost."""
    win = result.ranked[0]
    lay = win.layout
    lines = [f"\nwinner: pp={lay.pp} dp={lay.dp} tp={lay.tp} zero={lay.zero} "
             f"micro-batch={lay.micro_batch} x {lay.microbatches} {lay.schedule} "
             f"recompute={'on' if lay.recompute else 'off'} sp={'on' if lay.sp else 'off'}: "
             f"step {win.step:.4g} s",
             f"  {m.params / 1e9:.4g}B params = 12lh^2 + 13lh + (V + s)h ({NARAYANAN}, eq. 2)"]
    lines += _terms("time (the busiest stage's work; bubble and exposed communication added):",
                    win.time, "s")
    rank = dev.per_rank(n)
    lines += _terms(f"memory per device (limit {rank.usable_bytes / 1e9:.3g} GB = "
                    f"({rank.memory_bytes / 1e9:.4g} GB - CUDA context {rank.context_bytes / 1e9:.3g}"
                    f" GB) x (1 - fragmentation {rank.fragmentation:.3g})):", win.mem, "GB")
    lines += _terms("bytes one device sends per step:", win.wire, "GB")
    flops = "96" if lay.recompute else "72"
    lines += [f"TFLOP/s per device = {flops} B s l h^2 (1 + s/6h + V/16lh) / (N step) = "
              f"{throughput(m, win, n, batch) / 1e12:.4g} ({NARAYANAN}, eq. 3)",
              f"MFU = 72 B s l h^2 (1 + s/6h + V/16lh) / (N step peak {DTYPE}) = "
              f"{mfu(m, win, dev, n, batch):.1%}"]
    lines.append(f"device {dev.key}: {dev.name}")
    lines += [f"  {k}: {v}" for k, v in dev.sources.items()]
    if len(result.ranked) > 1:
        lines += _runner_up(win, result.ranked[1])
    return "\n".join(lines)


def _runner_up(win: Estimate, second: Estimate) -> list[str]:
    lay = second.layout
    lines = [f"runner-up: pp={lay.pp} dp={lay.dp} tp={lay.tp} zero={lay.zero} "
             f"micro-batch={lay.micro_batch} {lay.schedule} "
             f"recompute={'on' if lay.recompute else 'off'} sp={'on' if lay.sp else 'off'}: "
             f"step {second.step:.4g} s, {second.step - win.step:+.4g} s; it loses on:"]
    ours = {t.name.split(" (")[0]: t.value for t in win.time}
    theirs = {t.name.split(" (")[0]: t.value for t in second.time}
    diffs = sorted(((theirs.get(k, 0.0) - ours.get(k, 0.0), k) for k in set(ours) | set(theirs)),
                   reverse=True)
    lines += [f"  {k:<42} {d:>+10.4g} s" for d, k in diffs if abs(d) > 1e-9]
    if second.step - win.step < 1e-6:
        lines.append(f"  a tie on time; the winner needs {win.memory / 1e9:.3g} GB, "
                     f"the runner-up {second.memory / 1e9:.3g} GB")
    return lines
