"""``LLMRL_PROFILE=DIR`` profiles a server rank's second request of each kind and writes its tables to DIR; without
the variable, or for other requests, nothing is profiled or written (in-process: the context manager the server
wraps each request in)."""

from __future__ import annotations

import torch

from llmrl.engine.server.request_profile import profiled


def _work() -> torch.Tensor:
    a = torch.randn(64, 64)
    return torch.mm(a, a).sum()


def test_the_second_request_of_a_kind_is_profiled_into_the_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMRL_PROFILE", str(tmp_path / "prof"))
    for count in (1, 2, 3):
        with profiled("score", count, 4, "cpu"):
            value = _work()
    assert torch.isfinite(value)
    written = sorted(p.name for p in (tmp_path / "prof").iterdir())
    assert written == ["rank4-score.txt"]
    text = (tmp_path / "prof" / "rank4-score.txt").read_text()
    assert text.startswith("score request 2 on rank 4:") and "aten::mm" in text and "self_cpu_time_total" in text
    header = text.splitlines()[0]
    assert int(header.split("; ")[1].split(" aten operator calls")[0]) >= 3  # randn, mm, sum at least


def test_nothing_is_profiled_without_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv("LLMRL_PROFILE", raising=False)
    monkeypatch.chdir(tmp_path)
    with profiled("update", 2, 1, "cpu"):
        assert not torch.autograd.profiler._is_profiler_enabled
    assert list(tmp_path.iterdir()) == []


def test_a_request_served_inside_a_profiled_one_is_not_profiled_again(tmp_path, monkeypatch):
    """A weight write sent in flight is served inside the ``generate`` in progress: both may be the second of their
    kind, and torch's profiler cannot start inside itself."""
    monkeypatch.setenv("LLMRL_PROFILE", str(tmp_path / "prof"))
    with profiled("generate", 2, 1, "cpu"):
        with profiled("write_weights", 2, 1, "cpu"):
            value = _work()
    assert torch.isfinite(value)
    assert sorted(p.name for p in (tmp_path / "prof").iterdir()) == ["rank1-generate.txt"]
    with profiled("score", 2, 1, "cpu"):  # and the next one is profiled as before
        _work()
    assert (tmp_path / "prof" / "rank1-score.txt").exists()
