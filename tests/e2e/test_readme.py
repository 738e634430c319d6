"""The README's two commands are the ones the project really runs.

`make demo` must run the main job that tests/e2e/test_examples.py runs, and `.ci/run`
must call the README's test command and nothing else, so neither can rot unnoticed.
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def first_code_block(text: str) -> list[str]:
    block = re.search(r"```\w*\n(.*?)```", text, re.S).group(1)
    return [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]


def make_recipe(target: str) -> list[str]:
    lines = (ROOT / "Makefile").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{target}:"))
    recipe = []
    for line in lines[start + 1:]:
        if not line.startswith("\t"):
            break
        recipe.append(line.strip())
    return recipe


def test_readme_opens_with_exactly_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    assert readme.index("```") < readme.index("\n## "), "the commands must come first"
    assert first_code_block(readme) == ["make demo", "make test"]


def test_demo_is_the_main_job_the_e2e_test_runs():
    recipe = make_recipe("demo")
    assert recipe == ["$(VENV)/bin/disttrain run --nproc 4 examples/digits.py"]
    e2e = (ROOT / "tests/e2e/test_examples.py").read_text()
    assert '"run", "--nproc", "4", DIGITS' in e2e


def test_ci_runs_the_readme_test_command_only():
    commands = [line.strip() for line in (ROOT / ".ci/run").read_text().splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    assert commands[-1] == "make test"
    assert all(c.startswith(("set ", "cd ")) or c == "make lint" for c in commands[:-1])
    assert any("pytest" in line for line in make_recipe("test"))
