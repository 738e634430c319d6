"""`import disttrain` and the light subcommands of the `disttrain` command import no torch.

Each check runs a fresh interpreter (this one has torch already); a few tenths of a second.
"""

import subprocess
import sys

import pytest

import disttrain


def _imports_torch(code: str) -> bool:
    probe = f"import sys\n{code}\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()[-1] == "True"


@pytest.mark.parametrize("argv", [["--version"], ["cluster", "list", "--help"],
                                  ["cluster", "up", "--help"]])
def test_the_command_imports_no_torch_for_version_and_cluster(argv):
    code = f"from disttrain import cli\ntry:\n    cli.main({argv!r})\nexcept SystemExit:\n    pass"
    assert not _imports_torch(code)


def test_import_disttrain_imports_no_torch_until_a_name_is_used():
    assert not _imports_torch("import disttrain")
    assert _imports_torch("import disttrain\ndisttrain.init")


def test_every_name_resolves_to_its_home_and_is_listed():
    assert disttrain.init is disttrain.runtime.init
    assert disttrain.Zero.__module__.startswith("disttrain.parallel.zero")
    assert disttrain.settings.__name__ == "disttrain.settings"
    assert set(disttrain.__all__) <= set(dir(disttrain))
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        disttrain.no_such_name  # noqa: B018


def test_the_full_help_still_lists_every_subcommand(capsys):
    from disttrain import cli
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert all(name in out for name in cli.COMMANDS)
