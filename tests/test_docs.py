"""The README's snippets and the quickstart run and say what they claim."""

import re
import runpy
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_readme_python_snippets_run(capsys):
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert blocks
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})


def _readme_commands() -> list[str]:
    """The first line of each ```bash block of the README, as .ci/run reads them."""
    return re.findall(r"```bash\n(.*?)\n", (ROOT / "README.md").read_text())


def test_readme_commands_are_what_ci_runs():
    quickstart, tests = _readme_commands()[:2]
    # torch pinned: an open range would download a multi-GB CUDA build
    assert quickstart == "pip install torch==2.13.0 -e . && python examples/quickstart.py"
    assert tests == 'pip install torch==2.13.0 -e ".[test]" && python -m pytest'
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python3 -m venv" in ci and "README.md" in ci and 'bash -c "$tests"' in ci


def test_quickstart_runs(capsys):
    runpy.run_path(str(ROOT / "examples" / "quickstart.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "equals the unsharded result: True" in out and "grad equals 2*w: True" in out
    assert "False" not in out


def _run_example(name: str, capsys) -> str:
    runpy.run_path(str(ROOT / "examples" / name), run_name="__main__")
    return capsys.readouterr().out


def test_shard_model_example_matches_unsharded(capsys):
    out = _run_example("shard_model.py", capsys)
    diff = float(re.search(r"max \|sharded - unsharded\| = ([0-9.e+-]+)", out).group(1))
    assert diff < 1e-5 and "{'all_reduce': 2}" in out


def test_dropout_example_masks_do_not_depend_on_the_sharding(capsys):
    out = _run_example("dropout_train.py", capsys)
    losses = re.findall(r"losses (\[[^\]]*\])\s+masks identical: True", out)
    assert len(losses) == 3 and len(set(losses)) == 1
    assert "sharded and unsharded masks identical: True" in out
