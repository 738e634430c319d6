"""Every ```python block of README.md, read from the README when the tests run.

A block runs unless the line before its fence marks it:

    <!-- snippet: fragment -->                     only compiled (it needs what the
                                                   page leaves out: 8 processes, a GPT)
    <!-- snippet: run --nproc 2 -->                run by the real CLI: `disttrain run
    <!-- snippet: run --workers 3 --servers 1 -->  --nproc 2 snippet.py` in a tmp dir

An unmarked block runs as `python snippet.py`. A block that runs is prefixed by USER_CODE:
the names a README snippet leaves to its reader (`MyModel`, `dataset`, `loss_fn`, a
`model`, a `loader`, a batch `x, y`, an optimizer `factory`), small enough to run in
seconds. Compiling every block is fast; running the ones that need several processes
takes about 20 s on 2 cores, so those are marked slow.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_launcher import clean_env

ROOT = Path(__file__).resolve().parents[2]
MARK = re.compile(r"<!--\s*snippet:\s*(.*?)\s*-->")
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)

USER_CODE = '''\
import torch, disttrain
from torch import nn

disttrain.init()
torch.manual_seed(0)


class MyModel(nn.Sequential):
    def __init__(self):
        super().__init__(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


dataset = torch.utils.data.TensorDataset(torch.randn(512, 8), torch.randint(0, 4, (512,)))
loss_fn = nn.functional.cross_entropy
model = MyModel()
loader = [(torch.randn(16, 8), torch.randint(0, 4, (16,))) for _ in range(4)]
x, y = loader[0]
factory = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
'''


def snippets() -> list[tuple[int, str, str]]:
    """(line, how, code) for every ```python block of README.md; how is the marker's
    text ("fragment", "run --nproc 2", ...) or "run" when there is none."""
    text = (ROOT / "README.md").read_text()
    out = []
    for m in FENCE.finditer(text):
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = MARK.fullmatch(before.strip())
        out.append((text.count("\n", 0, m.start()) + 2, mark.group(1) if mark else "run",
                    m.group(1)))
    return out


def _id(snippet) -> str:
    return f"README.md:{snippet[0]}"


def test_the_readme_has_python_snippets_and_every_marker_is_known():
    found = snippets()
    assert len(found) >= 5
    for line, how, _ in found:
        assert how == "fragment" or how.split()[0] == "run", (
            f"README.md:{line}: unknown marker <!-- snippet: {how} -->; use "
            "<!-- snippet: fragment --> or <!-- snippet: run [disttrain run options] -->")


@pytest.mark.parametrize("snippet", snippets(), ids=_id)
def test_every_snippet_compiles(snippet):
    line, _, code = snippet
    compile(code, f"README.md:{line}", "exec")


def _runs(launched: bool) -> list:
    return [s for s in snippets() if s[1] != "fragment" and (len(s[1].split()) > 1) == launched]


def _run(snippet, tmp_path, timeout: float) -> None:
    line, how, code = snippet
    script = tmp_path / "snippet.py"
    script.write_text(f"{USER_CODE}\n# ---- README.md, line {line}\n{code}")
    options = shlex.split(how)[1:]
    cmd = ([sys.executable, "-m", "disttrain", "run", *options, str(script)] if options
           else [sys.executable, str(script)])
    env = clean_env(OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, (
        f"README.md:{line} ({how}) exited {proc.returncode}; mark it <!-- snippet: fragment "
        f"--> if it is not meant to run\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n"
        f"{proc.stderr[-3000:]}")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("snippet", _runs(launched=False), ids=_id)
def test_one_process_snippets_run(snippet, tmp_path):
    _run(snippet, tmp_path, timeout=50)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("snippet", _runs(launched=True), ids=_id)
def test_launched_snippets_run_under_disttrain_run(snippet, tmp_path):
    _run(snippet, tmp_path, timeout=110)
