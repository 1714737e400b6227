"""Shared fixtures: tiny offline models (built once per session) and live runs."""

from __future__ import annotations

import os
import tempfile

import pytest

# Tiny models are built once per test session into one folder shared with every launched rank.
os.environ.setdefault("LLMRL_TEST_MODELS", os.path.join(tempfile.gettempdir(), "llmrl-tiny-models"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Idle OpenMP threads sleep at once instead of spinning for the next parallel region: the suite runs more processes
# than there are cores (ranks, references in this process, and the other pytest-xdist worker), where a spinning
# thread only takes time from one that has work. Read when a process starts: set before any run is started.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# torch.compile compiles in the compiling process: its default pool of compile workers (one fresh interpreter per core,
# importing torch and inductor, in every process that compiles) costs more than the tiny models' kernels it builds.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# Without a GPU, DeepSpeed's accelerator is the CPU, as `llmrl run` (all-CPU configs), CPU servers and the builtin
# models' builder set it: the processes the tests start then agree with the fork server's environment
# (testkit.zygote), and DeepSpeed need not probe for a GPU when it is imported.
if not any(os.path.exists(device) for device in ("/dev/nvidiactl", "/dev/kfd")):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
HERE = os.path.dirname(os.path.abspath(__file__))
# Ranks import test plugins (module:attr) from here.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH")) if p)


def pytest_configure(config):
    """The suite's time budget (:mod:`testkit.budget`): the slowest tests and the total at the end, and no test over a
    minute."""
    from testkit import budget

    config.pluginmanager.register(budget, "llmrl-suite-budget")


def pytest_collection_finish(session):
    """Freeze what collection imported (torch, transformers, DeepSpeed, the test modules) out of the garbage
    collector's sight: the tests' collections then walk only what the tests made, not millions of library objects."""
    import gc

    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session", autouse=True)
def live_runs_in_pytests_basetemp(tmp_path_factory):
    """Each live run's folder (config, log) under pytest's basetemp, which pytest prunes, not loose in /tmp."""
    from testkit import live

    live.WORK_ROOT = str(tmp_path_factory.mktemp("live-runs"))


def pytest_terminal_summary(terminalreporter):
    """How the session's live runs started: forked by testkit.zygote's server, or afresh and why (a run given its own
    environment, say), so that a change that stops runs from forking shows."""
    from testkit import zygote

    if zygote.STARTS:
        counts = ", ".join(f"{n} {how}" for how, n in zygote.STARTS.most_common())
        terminalreporter.write_line(f"live runs: {counts}")


@pytest.fixture(scope="session")
def tiny():
    """Paths of the tiny models: tiny["llama"], tiny["gpt2"], tiny["t5"], and the variants tiny["llama-eos"] (its
    tokenizer appends EOS) and tiny["t5-genstart"] (decoder start token only in the generation config)."""
    from testkit import tiny_model

    return {kind: tiny_model(kind) for kind in ("llama", "gpt2", "t5", "llama-eos", "t5-genstart")}


@pytest.fixture(scope="session")
def reference_models():
    """In-process (model, tokenizer) pairs identical to the saved tiny models."""
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer

    from testkit import tiny_model

    out = {}
    for kind in ("llama", "gpt2", "t5", "llama-eos", "t5-genstart"):
        path = tiny_model(kind)
        cls = AutoModelForSeq2SeqLM if kind.startswith("t5") else AutoModelForCausalLM
        model = cls.from_pretrained(path).eval()
        out[kind] = (model, AutoTokenizer.from_pretrained(path))
    return out


@pytest.fixture
def live_run():
    """Factory of LiveRun objects that are all stopped (and their processes killed) after the test."""
    from testkit import LiveRun

    runs = []

    def start(config, **kwargs):
        run = LiveRun(config, **kwargs)
        runs.append(run)
        return run

    yield start
    for run in runs:
        if run.process.poll() is None:
            run.kill()


# The modules that take longest (live runs through DeepSpeed's launcher, several processes, real training), in the
# order pytest-xdist should start them: it hands whole files (``--dist loadfile``) to its workers in collection
# order, so the long ones run first and the short ones fill in at the end. A hint for the schedule, not a check.
LONGEST_FIRST = ("test_interruptions_live", "test_benchmark_smoke", "test_launch_live", "test_reliability_live",
                 "test_builtin_cache", "test_demo_smoke", "test_builtin_live", "test_tinker_recipes_live",
                 "test_two_hosts_live", "test_rlhf_live", "test_builtin_smollm2", "test_token_budget_live",
                 "test_tinker_service_live", "test_training_live", "test_load_live", "test_serving_live",
                 "test_hardening_live", "test_adapter_isolation_live", "test_checkpoint_live", "test_links",
                 "test_plugins_live", "test_decoding", "test_docs_reference")


def pytest_collection_modifyitems(items):
    """Long modules first (:data:`LONGEST_FIRST`), then the other multi-process ones (``slow``), then the rest, each
    group in its own order."""
    def rank(item):
        module = item.path.stem
        if module in LONGEST_FIRST:
            return LONGEST_FIRST.index(module)
        return len(LONGEST_FIRST) + (item.get_closest_marker("slow") is None)

    items.sort(key=rank)  # stable: tests keep their order within a module
