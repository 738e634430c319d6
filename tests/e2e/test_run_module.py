"""`disttrain run -m package.module` as a torchrun or `python -m` user types it: real ranks.

The module imports only the standard library, so a launch costs about a second.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.e2e.test_launcher import clean_env

MODULE = '''\
import json, os, sys
print("REPORT " + json.dumps({"rank": int(os.environ["RANK"]), "world": int(os.environ["WORLD_SIZE"]),
      "name": __name__, "argv": sys.argv, "path0": sys.path[0], "helper": __import__("app.helper").helper.X}))
'''


def _run(cwd, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "disttrain", "run", *args], cwd=cwd,
                          env=clean_env(), capture_output=True, text=True, timeout=60)


def test_run_m_runs_a_module_on_every_rank_as_python_m_does(tmp_path):
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "__init__.py").write_text("")
    (tmp_path / "app" / "helper.py").write_text("X = 7\n")
    (tmp_path / "app" / "train.py").write_text(MODULE)
    out = _run(tmp_path, "--nproc_per_node", "2", "-m", "app.train", "--lr", "3")
    assert out.returncode == 0, out.stderr
    reports = sorted((json.loads(line.partition("REPORT ")[2]) for line in out.stdout.splitlines()
                      if "REPORT " in line), key=lambda r: r["rank"])
    assert [(r["rank"], r["world"]) for r in reports] == [(0, 2), (1, 2)]
    for r in reports:  # as `python -m app.train --lr 3` from tmp_path
        assert r["name"] == "__main__" and r["argv"] == [str(tmp_path / "app" / "train.py"), "--lr", "3"]
        assert r["path0"] == str(tmp_path) and r["helper"] == 7


def test_run_m_of_a_module_that_is_not_there_says_how_to_fix_it(tmp_path):
    out = _run(tmp_path, "--nproc", "2", "-m", "nothere.train")
    assert out.returncode == 2
    assert "no module named 'nothere'" in out.stderr and "run from the folder that holds it" in out.stderr
