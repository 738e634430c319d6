"""`disttrain report`: each injected cause is named in the first lines; the page renders.

Three real traced jobs through `disttrain run --trace`: a data-parallel job whose rank 1
sleeps in its loader, a parameter-server job with a `--straggler` worker, a pipeline with
one micro-batch over two stages. The slow-loader report is also opened in headless
Chromium: no console message, every chart decoded, a screenshot kept in test-artifacts/.
"""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from disttrain import trace
from tests.e2e.test_launcher import SCRIPTS, disttrain

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("DISTTRAIN_ARTIFACTS", ROOT / "test-artifacts"))


def _report(directory: Path) -> list[str]:
    res = disttrain("report", str(directory), timeout=120)
    assert res.returncode == 0, res.stderr
    assert (directory / "report.html").exists() and (directory / "report" / "breakdown.png").exists()
    return res.stdout.splitlines()


def _traced(tmp_path: Path, *args: str) -> Path:
    out = tmp_path / "trace"
    res = disttrain("run", "--trace", str(out), *args, timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    return out


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found
    if os.environ.get("CI"):
        pytest.fail("chromium is missing on CI: .ci/run installs it (apt-get install -y chromium)")
    pytest.skip("chromium is not installed here and this is not CI: apt-get install -y chromium "
                "(bash .ci/run installs it)")


@pytest.mark.timeout(300)
def test_slow_loader_rank_is_named_and_the_page_renders_in_chromium(tmp_path):
    out = _traced(tmp_path, "--nproc", "2", str(SCRIPTS / "traced_dp.py"), "--steps", "6",
                  "--slow-rank", "1", "--slow-ms", "15")
    lines = _report(out)
    assert lines[0].startswith("rank 1 is ") and "of the gap is data loading" in lines[0], lines
    browser = _chromium()
    page = (out / "report.html").resolve().as_uri()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "report_slow_loader.png"
    shot.unlink(missing_ok=True)
    # NOTE: one browser start does both (headless Chromium runs --dump-dom and --screenshot
    # in turn): the page's DOM on stdout, its console on stderr, the screenshot in `shot`.
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             "--virtual-time-budget=5000", "--window-size=1100,1600"]
    dom = subprocess.run([browser, *flags, "--enable-logging=stderr", "--v=0", f"--screenshot={shot}",
                          "--dump-dom", page], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-3000:]
    console = [x for x in dom.stderr.splitlines() if ":CONSOLE" in x]
    assert console == [], console  # a page with any console message (an error) fails here
    charts = dom.stdout.count('class="chart"')
    assert charts == 2 and f'data-charts-rendered="{charts}"' in dom.stdout, dom.stdout[:500]
    assert "rank 1 is " in dom.stdout
    assert shot.stat().st_size > 10_000


# NOTE: slow-marked for suite time: the report's straggler diagnosis stays in the fast tier
# (test_slow_loader_rank_is_named...); this parameter-server job runs with DISTTRAIN_SLOW=1.
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ps_straggler_worker_is_named(tmp_path):
    out = _traced(tmp_path, "--workers", "3", "--servers", "1", str(ROOT / "examples" / "digits_ps.py"),
                  "--epochs", "1", "--mode", "async", "--straggler", "fixed:rank=1,delay=0.04",
                  "--step", "constant")  # the old rule: momentum 0.9 at full lr, warned about
    lines = _report(out)
    assert lines[0].startswith("rank 1 is ") and "idle in 'sleep (injected delay)'" in lines[0], lines
    ps_line = next(x for x in lines if x.startswith("parameter server: "))
    assert "mean staleness" in ps_line and "WARNING" in ps_line and "momentum 0.9" in ps_line, ps_line
    assert (out / "report" / "ps.png").exists()
    tr = json.loads((out / "trace.json").read_text())
    assert trace.problems(tr) == []  # flows included: every arrow has both ends, inside spans
    ids = {e["id"] for e in tr["traceEvents"] if e["ph"] == "f"}
    assert any(i.startswith("push s0 w1 ") for i in ids) and any(i.startswith("apply s0 v") for i in ids)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    later = [m for m in lines if m["step"] > 0]  # a worker's first push has no previous one
    assert later and all(m["ps_updates_per_s"] > 0 and m["ps_staleness"] >= 0 for m in later), later[:3]
    # async, 3 workers: between two pulls of a worker the others' pushes were applied too
    assert max(m["ps_staleness"] for m in later) >= 1, [m["ps_staleness"] for m in later]


@pytest.mark.timeout(300)
def test_pipeline_with_too_few_microbatches_is_named(tmp_path):
    out = _traced(tmp_path, "--nproc", "2", str(ROOT / "examples" / "gpt_char.py"), "--pp", "2",
                  "--microbatches", "1", "--steps", "4", "--n-layer", "2", "--log-every", "100")
    lines = _report(out)
    bubble = [x for x in lines if x.startswith("pipeline bubble is ")]
    assert bubble and "1 micro-batch over 2 stages" in bubble[0] and "use more micro-batches" in bubble[0]
    assert lines.index(bubble[0]) <= 1, lines
    assert (out / "report" / "pipeline.png").exists()
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 8 and all(m["tokens"] == 16 * 64 and m["loss"] > 0 for m in steps)  # B x T
    assert all(m["tokens_per_s"] == pytest.approx(m["tokens"] / m["step_time"]) for m in steps)
    # the stage's compute is its F/B spans (the runtime's own timings) plus the optimizer
    # step: counted once, whatever hooks the stage's modules would have had
    events = json.loads((out / "trace.json").read_text())["traceEvents"]
    for m in steps:
        main = [e for e in events if e["ph"] == "X" and e["pid"] == m["rank"] and e["tid"] == 0]
        (step,) = [e for e in main if e["name"] == f"step {m['step']}"]
        inside = [e for e in main if e["cat"] in ("compute", "pipeline") and step["ts"] <= e["ts"]
                  and e["ts"] + e["dur"] <= step["ts"] + step["dur"] + 0.01]
        assert {e["name"][0] for e in inside} == {"F", "B", "o"}, sorted(e["name"] for e in inside)
        assert sum(e["dur"] for e in inside) / 1e6 == pytest.approx(m["compute"], abs=0.02 * m["step_time"])
        assert m["compute"] + m["exposed_comm"] + m["data"] + m["idle"] == pytest.approx(m["step_time"])
