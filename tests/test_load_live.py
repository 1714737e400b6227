"""Load: 2,000 small requests in a row and 200 concurrent async requests complete with correct results,
and the servers' memory does not grow across them."""

import json
import os

import pytest
import yaml

from testkit.scripts import run_script

pytestmark = pytest.mark.slow
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.budget(120, why="2,000 requests and 200 concurrent ones are its subject: 67 s on a 2-core AVX2-only "
                              "EPYC with the other worker busy")
def test_two_thousand_requests_and_two_hundred_concurrent(tmp_path, tiny):
    """The script runs as rank 0 under the tests' launcher (the subject is serving, not launching)."""
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"llms": {"main": {"model": tiny["llama"], "replicas": 2}},
                                      "threads_per_rank": 1}))
    out = tmp_path / "load.json"
    result = run_script(str(config), os.path.join(HERE, "scripts", "load.py"), [str(out), "2000"], timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["wrong"] == 0 and report["concurrent_wrong"] == 0 and report["concurrent"] == 200
    start, middle, end = report["rss_mb"]
    for rank in start:
        growth = end[rank] - start[rank]
        print(f"rank {rank}: RSS {start[rank]:.1f} MB -> {middle[rank]:.1f} MB -> {end[rank]:.1f} MB")
        assert growth < 32, f"rank {rank} grew by {growth:.1f} MB over 2,000 requests"
        assert end[rank] - middle[rank] < 16, "memory must not keep growing"
