"""Packaging a user meets: the distribution name on the package index is vt-serve (`vt` there is
another project), the README installs it by that name, CI runs the README's test command, and
`vt bench --plot` without its extra stops before the run with one line naming the extra."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import vt
from vt.bench import run as bench

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = (ROOT / "pyproject.toml").read_text()
README = (ROOT / "README.md").read_text()
CI_RUN = (ROOT / ".ci" / "run").read_text()


def test_the_distribution_is_vt_serve_with_the_vt_package_and_command():
    # read as text: tomllib is not in Python 3.10
    assert re.search(r'^name = "vt-serve"$', PYPROJECT, re.M)
    assert re.search(r'^\[project\.scripts\]\nvt = "vt\.launch\.cli:main"$', PYPROJECT, re.M)
    assert re.search(r'^version = \{attr = "vt\.__version__"\}$', PYPROJECT, re.M)
    assert re.fullmatch(r"\d+\.\d+\.\d+", vt.__version__)
    for extra in ("bench", "test", "cuda12", "cuda13"):
        assert re.search(rf"^{extra} = \[", PYPROJECT, re.M), extra


def test_readme_starts_with_clone_venv_and_installs_by_the_distribution_name():
    first_block = README.split("```bash", 1)[1].split("```", 1)[0]
    assert "git clone" in first_block and "cd vt" in first_block and "python3 -m venv" in first_block
    assert "vt-serve" in README.split("##", 1)[0]  # said before the first section
    for spec in re.findall(r"pip install (?!-e)(?:-\S+ )*'?([A-Za-z][\w.-]*)(?![\w./-])", README):
        assert spec == "vt-serve", f"README installs {spec!r} from the package index"
    benchmarks = README.split("## Benchmarks", 1)[1].split("\n## ", 1)[0]
    assert "[bench]" in benchmarks


def test_ci_runs_the_readme_test_command_lint_first_with_skip_reasons():
    first_block = README.split("```bash", 1)[1].split("```", 1)[0]
    (test_line,) = [line for line in first_block.splitlines() if "pytest" in line]
    install, _, command = test_line.partition(" && ")
    assert install == "pip install -e '.[test]'"
    assert "python3 -m pip install -q -e '.[test]'" in CI_RUN.splitlines()
    assert command in CI_RUN.splitlines(), f"{command!r} is not what .ci/run runs"
    lint, _, tests = command.partition(" && ")
    report = [arg[2:] for arg in tests.split() if arg.startswith("-r")]
    # -r replaces pytest's default summary (fE): failures and errors stay listed beside the skips
    assert lint.endswith("ruff check .") and "pytest" in tests and report and set("fEs") <= set(report[0])


def test_bench_plot_without_matplotlib_fails_before_the_run_in_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    monkeypatch.setattr(bench, "run_single", lambda cfg: (_ for _ in ()).throw(AssertionError("ran")))
    assert bench.main(["--base-url", "http://127.0.0.1:9", "--plot", "out.png"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "vt-serve[bench]" in err and "Traceback" not in err
