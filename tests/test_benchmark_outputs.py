"""A benchmark's ``--out`` results file: a new file, or one a benchmark wrote, may be (over)written; a user's file
never is, and the benchmark stops before it measures anything, naming the file."""

import json
import os

import pytest

from benchmarks.kit import WRITER_KEY, claim_results_file
from testkit.scripts import run_module

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_new_file_or_a_benchmarks_own_may_be_written(tmp_path):
    out = tmp_path / "results.json"
    mark = claim_results_file(str(out), "run")
    assert mark == {WRITER_KEY: "llmrl benchmarks.run"} and not out.exists()
    out.write_text(json.dumps({**mark, "rows": []}))
    assert claim_results_file(str(out), "decoding") == {WRITER_KEY: "llmrl benchmarks.decoding"}


@pytest.mark.parametrize("text", ['{"rows": []}', "my notes", "[1, 2]", '{"written by": "me"}', ""])
def test_a_users_file_is_refused_by_name_and_left_as_it_was(tmp_path, text):
    out = tmp_path / "results.json"
    out.write_text(text)
    with pytest.raises(SystemExit, match=f"{out} exists and was not written by an llmrl benchmark.*another --out"):
        claim_results_file(str(out), "run")
    assert out.read_text() == text
    with pytest.raises(SystemExit, match="is a folder"):
        claim_results_file(str(tmp_path), "run")


@pytest.mark.parametrize("suite", ["run", "grpo_step", "decoding"])
def test_each_benchmark_refuses_before_it_measures(tmp_path, suite):
    out = tmp_path / "mine.json"
    out.write_text("a user's file")
    result = run_module(f"benchmarks.{suite}", ["--out", str(out)], cwd=ROOT, timeout=300)
    assert result.returncode == 1 and f"{out} exists and was not written by an llmrl benchmark" in result.stderr
    assert out.read_text() == "a user's file"
