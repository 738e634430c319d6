"""`disttrain report DIR`: one self-contained HTML page and PNG charts from a trace folder.

    disttrain report out/            # writes out/report.html and out/report/*.png

The page opens with the diagnosis (analysis.py) in words, then a table per rank and the
charts, each a PNG made with matplotlib (Agg, no display) and inlined as a data: URI, so
the page needs no network and no other file: time breakdown per rank (compute / exposed
communication / data / idle, mean per step), step time per step and rank, the pipeline
Gantt of one real step (when the job had a pipeline), the PS staleness histogram and
per-server load (when it had parameter servers). A few lines of inline script set
`data-charts-rendered` on <body> to the number of charts the browser decoded (the
headless-browser test reads it). The diagnosis is also printed.
"""

from __future__ import annotations

import base64
import html
import io
import os
import sys

from disttrain.trace import analysis

__all__ = ["write_report", "add_report_parser"]

COLORS = {"compute": "#4c78a8", "exposed_comm": "#e45756", "data": "#f58518", "idle": "#bab0ac",
          "F": "#4c78a8", "B": "#54a24b", "W": "#b279a2"}


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("disttrain report needs matplotlib: pip install 'disttrain[report]' "
                         "(or pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _breakdown(plt, rows):
    ranks = sorted(rows)
    fig, ax = plt.subplots(figsize=(8, 0.5 + 0.45 * len(ranks)))
    left = [0.0] * len(ranks)
    for part in analysis.PARTS:
        widths = [1e3 * max(0.0, rows[r][part]) for r in ranks]
        ax.barh([f"rank {r}" for r in ranks], widths, left=left, color=COLORS[part],
                label=analysis.WORDS[part])
        left = [a + b for a, b in zip(left, widths)]
    ax.invert_yaxis()
    ax.set_xlabel("ms per step (mean)")
    ax.set_title("Where each rank's step goes")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35 if len(ranks) < 4 else -0.12),
              ncol=4, fontsize=8)
    return fig


def _steps(plt, metrics):
    fig, ax = plt.subplots(figsize=(8, 3))
    by_rank: dict[int, list] = {}
    for m in metrics:
        by_rank.setdefault(m["rank"], []).append((m["step"], 1e3 * m["step_time"]))
    for rank, pts in sorted(by_rank.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=f"rank {rank}")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("step")
    ax.set_ylabel("step time (ms)")
    ax.set_title("Step time per rank")
    ax.legend(fontsize=8, ncol=4)
    return fig


def _gantt(plt, events):
    """One step's F/B/W actions per stage (the median-length step of the first rank)."""
    pipe = [e for e in events if e.get("cat") == "pipeline" and e.get("ph") == "X"]
    steps = [e for e in events if e.get("cat") == "step" and e.get("ph") == "X"]
    if not pipe or not steps:
        return None
    pid0 = min(e["pid"] for e in steps)
    mine = sorted((e for e in steps if e["pid"] == pid0), key=lambda e: e["dur"])
    step = mine[len(mine) // 2]
    t0, t1 = step["ts"], step["ts"] + step["dur"]
    shown = [e for e in pipe if t0 <= e["ts"] < t1]
    first = min((e["ts"] for e in shown), default=t0)
    fig, ax = plt.subplots(figsize=(9, 0.8 + 0.5 * (1 + max(e["args"]["stage"] for e in pipe))))
    for e in shown:
        kind = e["name"][0]
        y = e["args"]["stage"]
        ax.barh(y, e["dur"] / 1e3, left=(e["ts"] - first) / 1e3, color=COLORS.get(kind, "#888"),
                edgecolor="white")
        ax.text((e["ts"] - first + e["dur"] / 2) / 1e3, y, e["name"], ha="center", va="center",
                fontsize=7, color="white")
    ax.set_yticks(sorted({e["args"]["stage"] for e in pipe}))
    ax.set_yticklabels([f"stage {s}" for s in sorted({e["args"]["stage"] for e in pipe})])
    ax.invert_yaxis()
    ax.set_xlabel("ms (aligned clocks)")
    ax.set_title("Pipeline: one step's F/B/W per micro-batch (gaps are the bubble)")
    return fig


def _ps(plt, events):
    servers = analysis.ps_servers(events)
    if not servers:
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3))
    hist: dict[int, int] = {}
    for s in servers.values():
        for k, v in (s.get("staleness") or {}).items():
            hist[int(k)] = hist.get(int(k), 0) + int(v)
    a.bar(list(hist), list(hist.values()), color="#4c78a8")
    a.set_xlabel("staleness (versions)")
    a.set_ylabel("pushes applied")
    a.set_title("PS staleness")
    names = [f"server {s.get('server', pid)}" for pid, s in sorted(servers.items())]
    b.bar(names, [s.get("apply_spans", 0) for _, s in sorted(servers.items())], color="#54a24b")
    b.set_ylabel("updates applied")
    b.set_title("Per-server load")
    fig.tight_layout()
    return fig


def _figures(run) -> list[tuple[str, str, object]]:
    plt = _pyplot()
    rows = analysis.summarize(run)
    figs = [("breakdown", "Time breakdown per rank", _breakdown(plt, rows) if rows else None),
            ("steps", "Step time per rank", _steps(plt, run["metrics"]) if run["metrics"] else None),
            ("pipeline", "Pipeline Gantt", _gantt(plt, run["events"])),
            ("ps", "Parameter server", _ps(plt, run["events"]))]
    return [(name, title, fig) for name, title, fig in figs if fig is not None]


def _table(rows, nodes) -> str:
    head = "".join(f"<th>{h}</th>" for h in ("rank", *(["node"] if nodes else []), "steps", "step ms",
                                              "compute", "exposed comm", "data", "idle", "own ms", "bubble"))
    body = []
    for r, row in sorted(rows.items()):
        cells = [str(r), *([f"n{nodes[r]}" if r in nodes else "-"] if nodes else []), str(row["steps"]),
                 f"{1e3 * row['step_time']:.2f}"]
        cells += [f"{100 * row[p] / row['step_time']:.0f}%" if row["step_time"] else "-"
                  for p in analysis.PARTS]
        cells += [f"{1e3 * row['own']:.2f}",
                  f"{100 * row['pipeline_bubble']:.0f}%" if "pipeline_bubble" in row else "-"]
        body.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def bound_lines(run, bound) -> tuple[list[str], str]:
    """(one diagnosis line per modelled collective, the note on the cost inputs) from
    `bound` (see `write_report`); ([], "") without it."""
    if bound is None:
        return [], ""
    rows = analysis.collectives(run["events"], run["other"])
    verdicts, note = bound.judge(rows, run["other"])
    return [bound.sentence(r, v) for r, v in zip(rows, verdicts) if v is not None], note


def _comm_table(events, other, bound=None) -> str:
    rows = analysis.collectives(events, other)
    if not rows:
        return ""
    link = other.get("link_gbps")
    verdicts, note = bound.judge(rows, other) if bound is not None else ([None] * len(rows), "")
    heads = ["collective", "ranks", "calls", "bytes per call", "median ms", "achieved MB/s",
             "bus Gbit/s"] + ([f"of the {link:g} Gbit/s link"] if link else []) + \
        (["bound by (model ms)"] if bound is not None else [])
    body = []
    for r, v in zip(rows, verdicts):
        cells = [r["op"], str(r["n"]), str(r["calls"]), f"{r['bytes']:,.0f}",
                 f"{r['median_us'] / 1e3:.3f}", f"{r['mb_per_s']:,.1f}", f"{r['bus_gbps']:.3f}"]
        if link:
            cells.append("one node" if r["crosses_nodes"] is False else
                         f"{100 * r['link_share']:.0f}%" if r["link_share"] is not None else "-")
        if bound is not None:
            cells.append(f"{v['bound']} ({v['predicted_us'] / 1e3:.2f})" if v else "-")
        body.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    head = "".join(f"<th>{h}</th>" for h in heads)
    note = ("<p>Bus bandwidth: what each rank moved over its link per second (nccl-tests' "
            "convention: all-reduce 2(n-1)/n of the tensor, all-gather n-1, reduce-scatter "
            "(n-1)/n, broadcast and point-to-point 1), from issue to completion, so it includes "
            "waiting for the last rank to join."
            + (" Compared with the link rate `disttrain run --cluster` gave the ranks "
               "(DISTTRAIN_LINK_GBPS); groups inside one node do not use the link." if link else "")
            + (" Bound by: the part of comm/cost.py's model (latency, link bandwidth or CPU "
               f"pool) that dominates the collective; {html.escape(note)}." if bound is not None else "")
            + "</p>")
    return ("<h2>Collectives (issue to completion, every rank)</h2>"
            f"<table><tr>{head}</tr>{''.join(body)}</table>{note}")


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>disttrain report: {title}</title>
<style>body{{font-family:sans-serif;max-width:1000px;margin:2em auto;color:#222}}
ol.diagnosis li{{font-size:1.1em;margin:.4em 0}} table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:3px 8px;text-align:right}} img{{max-width:100%}}</style>
</head><body data-charts-rendered="0">
<h1>Where the time goes</h1><p>{title}</p>
<h2>Diagnosis</h2><ol class="diagnosis">{diagnosis}</ol>
<h2>Per rank (mean per step)</h2>{table}
{comm}
{charts}
<p>Timeline: open trace.json in Perfetto's UI or chrome://tracing.</p>
<script>
window.addEventListener("load", function () {{
  var n = 0, imgs = document.querySelectorAll("img.chart");
  for (var i = 0; i < imgs.length; i++) {{ if (imgs[i].complete && imgs[i].naturalWidth > 0) n++; }}
  document.body.setAttribute("data-charts-rendered", String(n));
}});
</script></body></html>
"""


def write_report(directory: str, out: str | None = None, bound=None) -> tuple[str, list[str]]:
    """Write the HTML page (default DIR/report.html) and DIR/report/*.png; return (path, diagnosis).

    `bound`: a module with `judge(rows, otherData) -> (verdicts, note)` and `sentence(row,
    verdict)` (disttrain/plan/bound.py, which cli.py hands in: trace cannot import comm's
    cost model), which adds what bound each collective to the diagnosis and the table."""
    run = analysis.load(directory)
    lines, note = bound_lines(run, bound)
    diagnosis = analysis.diagnose(run) + lines + ([note] if lines else [])
    png_dir = os.path.join(directory, "report")
    os.makedirs(png_dir, exist_ok=True)
    charts = []
    for name, title, fig in _figures(run):
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
        fig.clf()
        data = buf.getvalue()
        with open(os.path.join(png_dir, f"{name}.png"), "wb") as fp:
            fp.write(data)
        uri = "data:image/png;base64," + base64.b64encode(data).decode("ascii")
        charts.append(f'<h2>{html.escape(title)}</h2><img class="chart" alt="{html.escape(title)}" '
                      f'src="{uri}">')
    page = PAGE.format(title=html.escape(os.path.abspath(directory)),
                       diagnosis="".join(f"<li>{html.escape(d)}</li>" for d in diagnosis),
                       table=_table(analysis.summarize(run), analysis.nodes(run)), comm=_comm_table(run["events"], run["other"], bound),
                       charts="\n".join(charts))
    path = out or os.path.join(directory, "report.html")
    with open(path, "w", encoding="utf-8") as fp:
        fp.write(page)
    return path, diagnosis


def add_report_parser(subparsers, bound=None) -> None:
    p = subparsers.add_parser(
        "report", help="explain a traced job: diagnosis, per-rank breakdown, charts (HTML + PNG)",
        description="Read DIR/trace.json and DIR/metrics.jsonl (from `disttrain run --trace DIR`) "
                    "and write DIR/report.html (self-contained) and DIR/report/*.png.")
    p.add_argument("dir", help="the folder given to --trace")
    p.add_argument("--out", help="HTML file to write (default DIR/report.html)")
    p.set_defaults(handler=_run, bound=bound)


def _run(args) -> int:
    try:
        path, diagnosis = write_report(args.dir, args.out, args.bound)
    except (FileNotFoundError, ValueError) as err:
        print(f"disttrain report: error: {err}", file=sys.stderr)
        return 2
    for line in diagnosis:
        print(line)
    print(f"disttrain report: {path} (charts in {os.path.join(args.dir, 'report')})", file=sys.stderr)
    return 0
