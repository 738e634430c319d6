"""disttrain.settings: every DISTTRAIN_* variable parses its default, a bad value names the
variable and its fix, the README lists each one, and no module outside settings.py names
one (so a new read or write of the environment cannot slip past the settings object)."""

from __future__ import annotations

import ast
import dataclasses
import math
import os
import pathlib
import re
import subprocess
import sys

import pytest

import disttrain
from disttrain import runtime, settings
from disttrain.launch.job import RunConfig, rank_env
from disttrain.settings import Settings, SettingsError

SRC = pathlib.Path(disttrain.__file__).parent
README = SRC.parents[1] / "README.md"
FIELDS = {f.metadata["env"]: f for f in dataclasses.fields(Settings)}
TYPED = [name for name, f in FIELDS.items() if f.metadata["parser"] is not settings.TEXT]

# Each variable's default as a user would write it (None: the default is "unset").
DEFAULT_TEXT = {
    "DISTTRAIN_TIMEOUT": "60", "DISTTRAIN_SECRET": None, "DISTTRAIN_SERVERS": "0",
    "DISTTRAIN_REPORT_DIR": None, "DISTTRAIN_PEER_GRACE": "3", "DISTTRAIN_SUPERVISED": "0",
    "DISTTRAIN_PREEMPT_SIGNAL": None, "DISTTRAIN_TRACE": None, "DISTTRAIN_TRACE_STEPS": None,
    "DISTTRAIN_PS_TIMEOUT": "10", "DISTTRAIN_PS_WAIT": None, "DISTTRAIN_PS_HOST": "127.0.0.1", "DISTTRAIN_PS_ENCRYPT": "0",
    "DISTTRAIN_PS_MAC": "auto", "DISTTRAIN_PS_IPC": "1", "DISTTRAIN_PS_SHM": "1",
    "DISTTRAIN_PS_MANAGER": None,
    "DISTTRAIN_PS_TAKEOVER_FILE": None, "DISTTRAIN_PS_JOIN": "0",
    "DISTTRAIN_SCRATCH": None,
    "DISTTRAIN_LINK_GBPS": None,
    "DISTTRAIN_ALPHA_US": None, "DISTTRAIN_LOCAL_GBPS": None, "DISTTRAIN_LOCAL_ALPHA_US": None,
    "DISTTRAIN_STEP_US": "0", "DISTTRAIN_CPU_GBPS": "inf", "DISTTRAIN_CPU_LOCAL_GBPS": "inf",
    "DISTTRAIN_SHARED_CPU": "0", "DISTTRAIN_CLUSTER": None, "DISTTRAIN_CLUSTER_NODE": None,
    "DISTTRAIN_CLUSTER_CPUS": None,
    "DISTTRAIN_CLUSTER_REPORTS": None, "DISTTRAIN_CLUSTER_DIR": "/run/disttrain/clusters",
    "DISTTRAIN_CLUSTER_NO_CAPS": "0",
}

# Values each typed variable must refuse (beyond "abc", which every typed one refuses).
BAD = {
    settings.SECONDS: ["0", "-1", "nan", "inf"], settings.GRACE: ["-0.5", "inf"],
    settings.COUNT: ["-1", "1.5"], settings.FLAG: ["2", "yes", "true"],
    settings.MAC: ["never", "ALWAYS"], settings.GBPS: ["0", "-10", "nan"],
    settings.MICROS: ["-1", "inf"], settings.CORES: ["0", "-1", "inf"], settings.SIGNAL: ["SIGNOPE", "12"],
}


def test_every_variable_has_a_default_text_and_each_parses_to_its_default():
    assert set(DEFAULT_TEXT) == set(FIELDS)  # a new variable is added here too
    assert Settings.from_env({}) == Settings()
    for name, text in DEFAULT_TEXT.items():
        f = FIELDS[name]
        if text is None:
            assert f.default is None, name
            continue
        assert getattr(Settings.from_env({name: text}), f.name) == f.default, name


def test_empty_counts_as_unset():
    assert Settings.from_env({name: "" for name in FIELDS}) == Settings()


def test_each_variable_is_one_constant_named_after_it():
    constants = {v for k, v in vars(settings).items() if k.isupper() and isinstance(v, str)
                 and v.startswith("DISTTRAIN_")}
    assert constants == set(FIELDS)
    assert all(getattr(settings, name.removeprefix("DISTTRAIN_")) == name for name in FIELDS)


@pytest.mark.parametrize("name", TYPED)
def test_a_bad_value_names_the_variable_what_it_expects_and_a_value_that_works(name):
    parser = FIELDS[name].metadata["parser"]
    for bad in ["abc", *BAD[parser]]:
        with pytest.raises(SettingsError) as err:
            Settings.from_env({name: bad})
        msg = str(err.value)
        assert msg.startswith(f"{name}={bad!r}: expected {parser.expected}"), msg
        assert msg.endswith(f"e.g. {name}={parser.example}"), msg
        assert isinstance(err.value, ValueError)  # old callers catch ValueError
    Settings.from_env({name: parser.example})  # the suggested fix parses


def test_typed_values_parse():
    s = Settings.from_env({"DISTTRAIN_TIMEOUT": "7.5", "DISTTRAIN_SERVERS": "2",
                           "DISTTRAIN_PS_MAC": "always", "DISTTRAIN_PS_IPC": "0",
                           "DISTTRAIN_PREEMPT_SIGNAL": "SIGUSR2", "DISTTRAIN_LINK_GBPS": "1.5",
                           "DISTTRAIN_CLUSTER_NODE": "3", "DISTTRAIN_PEER_GRACE": "0"})
    assert (s.timeout, s.servers, s.ps_mac_always, s.ps_ipc, s.preempt_signal, s.link_gbps,
            s.cluster_node, s.peer_grace) == (7.5, 2, True, False, "SIGUSR2", 1.5, 3, 0.0)
    assert math.isinf(Settings.from_env({"DISTTRAIN_CPU_GBPS": "inf"}).cpu_gbps)


def test_the_secret_stays_out_of_the_repr():
    secret = "ab" * 32
    assert secret not in repr(Settings.from_env({"DISTTRAIN_SECRET": secret}))


def test_every_field_has_a_docstring():
    tree = ast.parse((SRC / "settings.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Settings")
    body = cls.body
    documented = {a.target.id for a, doc in zip(body, body[1:])
                  if isinstance(a, ast.AnnAssign) and isinstance(doc, ast.Expr)
                  and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)}
    assert documented == {f.name for f in FIELDS.values()}


def test_readme_table_lists_every_variable_with_its_default_and_who_sets_it():
    rows = {}
    for line in README.read_text().splitlines():
        m = re.match(r"\| `(DISTTRAIN_[A-Z_]+)` \| ([^|]*) \| ([^|]*) \|", line)
        if m:
            rows[m.group(1)] = (m.group(2).strip(), m.group(3).strip())
    assert set(rows) == set(FIELDS)
    for name, (default, what) in rows.items():
        text = DEFAULT_TEXT[name]
        assert (f"`{text}`" in default) if text is not None else default.startswith("unset"), name
        set_by = FIELDS[name].metadata["set_by"]
        assert (f"set by `{set_by}`" in what) == bool(set_by), name


def _names_outside_settings(root: pathlib.Path) -> list[str]:
    """Every place under `root` (but settings.py) that spells a DISTTRAIN_* name as a whole
    string or keyword: an environment read or write that bypasses the settings module."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "settings.py" and path.parent == root:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                    re.fullmatch(r"DISTTRAIN_[A-Z_]*", node.value):
                found.append(f"{path.relative_to(root)}:{node.lineno}: {node.value!r}")
            if isinstance(node, ast.keyword) and (node.arg or "").startswith("DISTTRAIN_"):
                found.append(f"{path.relative_to(root)}:{node.value.lineno}: {node.arg}=")
    return found


def test_no_module_but_settings_reads_or_writes_a_disttrain_variable_by_name():
    found = _names_outside_settings(SRC)
    assert not found, ("read DISTTRAIN_* through disttrain.settings.current() and write it "
                       "with the settings constants:\n" + "\n".join(found))


def test_the_name_check_sees_reads_and_writes(tmp_path):
    (tmp_path / "a.py").write_text('import os\nx = os.environ.get("DISTTRAIN_TIMEOUT", "60")\n'
                                   'y = os.getenv("DISTTRAIN_" + "X")\nz = dict(DISTTRAIN_TRACE="d")\n'
                                   'msg = "DISTTRAIN_SECRET is not set"\n')
    assert sorted(_names_outside_settings(tmp_path)) == [
        "a.py:2: 'DISTTRAIN_TIMEOUT'", "a.py:3: 'DISTTRAIN_'", "a.py:4: DISTTRAIN_TRACE="]


def test_read_once_until_refresh(monkeypatch):
    monkeypatch.setenv("DISTTRAIN_SERVERS", "1")
    first = settings.refresh()
    assert settings.current() is first and runtime.num_servers() == 1
    monkeypatch.setenv("DISTTRAIN_SERVERS", "3")  # not seen: the hot path reads no environment
    assert settings.current() is first and runtime.num_servers() == 1
    assert settings.refresh().servers == 3 and runtime.num_servers() == 3


def test_launcher_writes_what_the_ranks_read(tmp_path):
    cfg = RunConfig(script=__file__, workers=2, servers=1, timeout=7.5, trace=str(tmp_path),
                    trace_steps="2:5")
    s = Settings.from_env(rank_env(cfg, {}))
    assert (s.servers, s.timeout, s.trace_dir, s.trace_steps) == (1, 7.5, str(tmp_path), "2:5")
    assert len(bytes.fromhex(s.secret)) == 32


def test_launcher_refuses_a_bad_setting_before_starting_ranks():
    with pytest.raises(SettingsError, match=r"DISTTRAIN_PS_MAC='sometimes': expected 'auto' or 'always'"):
        rank_env(RunConfig(script=__file__), {"DISTTRAIN_PS_MAC": "sometimes"})


def test_rank_entry_reads_settings_without_the_package(tmp_path):
    """entry.py loads settings.py by path: a bad value ends the rank with the message, before
    the script runs, and the script starts without disttrain or torch imported."""
    script = tmp_path / "s.py"
    script.write_text("import sys\nprint(sorted(m for m in ('disttrain', 'torch') if m in sys.modules))\n")
    entry = SRC / "launch" / "entry.py"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTTRAIN_")}
    ok = subprocess.run([sys.executable, str(entry), str(script)], env=env, capture_output=True,
                        text=True, timeout=60)
    assert (ok.returncode, ok.stdout) == (0, "[]\n"), ok.stderr
    bad = subprocess.run([sys.executable, str(entry), str(script)], capture_output=True, text=True,
                         env={**env, "DISTTRAIN_PEER_GRACE": "-1"}, timeout=60)
    assert bad.returncode == 2 and bad.stdout == ""
    assert "DISTTRAIN_PEER_GRACE='-1': expected a number of seconds >= 0" in bad.stderr
