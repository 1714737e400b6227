"""`import llmrl` stays light: no deepspeed, no transformers (they load where they are used)."""

import subprocess
import sys


def _modules_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys; print(' '.join(sys.modules))"],
                         capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_import_llmrl_is_light():
    modules = _modules_after("import llmrl")
    assert "deepspeed" not in modules
    assert "transformers" not in modules
    assert "torch" not in modules


def test_caller_import_does_not_load_deepspeed_or_transformers():
    modules = _modules_after("from llmrl import Caller")
    assert "deepspeed" not in modules
    assert "transformers" not in modules
