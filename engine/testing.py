"""Test utilities, shipped so that plugin authors can reuse them: tiny offline models and references.

``tiny_model("llama" | "gpt2" | "t5")`` builds a two-layer random model and a small byte-level BPE
tokenizer trained in-process (no downloads), saves them as a normal Hugging Face folder and returns
its path; folders are cached per (kind, seed). ``reference_scores`` computes what ``score`` must
return the plain way: one full forward per (context, candidate) pair, no padding, no cache.

Nothing here is used by the engine itself.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

_CORPUS = [
    "You see a wall 2 steps forward, a red ball 1 step left and 2 steps forward.",
    "Goal of the agent: go to the red ball. Possible actions: turn left, turn right, go forward.",
    "pick up the blue key, open the door, drop the box, toggle the switch",
    "The quick brown fox jumps over the lazy dog. 0123456789 + - * / = ( ) [ ] { }",
    "Ünïcödé tëxt: café, naïve, über, smörgåsbord, 東京, Ελληνικά, эксперимент, 🙂",
    "In the kitchen you see a fridge, a table and a door leading north.",
    "Language models as policies: score the admissible actions, sample one, update with PPO.",
]

SPECIALS = {"pad": "<pad>", "bos": "<s>", "eos": "</s>", "unk": "<unk>"}


def tiny_tokenizer(add_bos: bool, add_eos: bool, vocab_size: int = 320):
    """A byte-level BPE tokenizer trained on a small built-in corpus (any unicode text encodes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS.values()),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    single = "$A"
    special = []
    if add_bos:
        single = "<s> " + single
        special.append(("<s>", tok.token_to_id("<s>")))
    if add_eos:
        single = single + " </s>"
        special.append(("</s>", tok.token_to_id("</s>")))
    tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=special)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def build_tiny(kind: str, seed: int = 0):
    """(model, tokenizer) of a tiny random model: llama (causal, BOS), gpt2 (causal, no BOS), t5 (seq2seq)."""
    import torch
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        T5Config,
        T5ForConditionalGeneration,
    )

    tokenizer = tiny_tokenizer(add_bos=(kind == "llama"), add_eos=(kind == "t5"))
    ids = {k: tokenizer.convert_tokens_to_ids(v) for k, v in SPECIALS.items()}
    vocab = len(tokenizer)
    torch.manual_seed(seed)
    if kind == "llama":
        config = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=128, vocab_size=vocab, max_position_embeddings=512,
                             bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"],
                             tie_word_embeddings=False)
        model = LlamaForCausalLM(config)
    elif kind == "gpt2":
        config = GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=512, vocab_size=vocab,
                            bos_token_id=ids["eos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"])
        model = GPT2LMHeadModel(config)
    elif kind == "t5":
        config = T5Config(d_model=64, d_ff=128, d_kv=16, num_layers=2, num_decoder_layers=2, num_heads=4,
                          vocab_size=vocab, decoder_start_token_id=ids["pad"], eos_token_id=ids["eos"],
                          pad_token_id=ids["pad"], relative_attention_num_buckets=8)
        model = T5ForConditionalGeneration(config)
    else:
        raise ValueError(f"unknown tiny model kind {kind!r}; use llama, gpt2 or t5")
    with torch.no_grad():  # random init is small; widen it so that scores differ visibly between candidates
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    model.eval()
    model.generation_config.pad_token_id = ids["pad"]
    return model, tokenizer


def tiny_model(kind: str, seed: int = 0, root: str | os.PathLike | None = None) -> str:
    """Path of a saved tiny model folder (built once per kind and seed)."""
    root = Path(root or os.environ.get("LLMRL_TEST_MODELS", Path(tempfile.gettempdir()) / "llmrl-tiny-models"))
    path = root / f"{kind}-seed{seed}"
    if (path / "config.json").is_file():
        return str(path)
    root.mkdir(parents=True, exist_ok=True)
    model, tokenizer = build_tiny(kind, seed)
    staging = Path(tempfile.mkdtemp(prefix=f".{kind}-", dir=root))
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    try:
        os.replace(staging, path)
    except OSError:  # another process won the race
        import shutil

        shutil.rmtree(staging, ignore_errors=True)
    return str(path)


def reference_scores(model, tokenizer, contexts: list[str], candidates: list[list[str]], seq2seq: bool = False):
    """Plain Hugging Face scores: one unpadded forward per pair, sum of the candidate's token log-probs."""
    import torch

    results = []
    with torch.no_grad():
        for context, cands in zip(contexts, candidates):
            row = []
            for cand in cands:
                if seq2seq:
                    enc = tokenizer(context, return_tensors="pt")
                    target = tokenizer(cand)["input_ids"]
                    if not target:
                        row.append(0.0)
                        continue
                    dec = [model.config.decoder_start_token_id] + target[:-1]
                    logits = model(**enc, decoder_input_ids=torch.tensor([dec])).logits[0]
                    lp = torch.log_softmax(logits.float(), -1)
                    row.append(sum(lp[t, tok].item() for t, tok in enumerate(target)))
                    continue
                ctx_ids = tokenizer(context)["input_ids"]
                full = tokenizer(context + cand)["input_ids"]
                p = 0
                while p < min(len(ctx_ids), len(full)) and ctx_ids[p] == full[p]:
                    p += 1
                if p == len(full):
                    row.append(0.0)
                    continue
                logits = model(input_ids=torch.tensor([full])).logits[0]
                lp = torch.log_softmax(logits.float(), -1)
                row.append(sum(lp[t - 1, full[t]].item() for t in range(p, len(full))))
            results.append(torch.tensor(row, dtype=torch.float32))
    return results


class LiveRun:
    """A real run (DeepSpeed launcher, every rank a process) whose client obeys this process.

    ``config`` is a mapping (written to a temporary YAML file) or a path. Methods of the run's
    :class:`~llmrl.Caller` are called as ``run.score(...)``; exceptions raised there are raised here.

    Example::

        with LiveRun({"llms": {"main": {"model": tiny_model("llama")}}}) as run:
            print(run.score(["a"], [[" b"]]))
    """

    def __init__(self, config, *, caller_kwargs: dict | None = None, overrides=(), env: dict | None = None,
                 startup_timeout: float = 300.0, workdir: str | None = None, check: bool = True):
        import secrets
        import subprocess
        from multiprocessing.connection import Listener

        import yaml

        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="llmrl-live-"))
        if isinstance(config, (str, os.PathLike)):
            self.config_path = str(config)
            with open(config) as f:
                raw = yaml.safe_load(f)
        else:
            raw = config
            self.config_path = str(self.workdir / "config.yaml")
            with open(self.config_path, "w") as f:
                yaml.safe_dump(config, f, sort_keys=False)
        from llmrl.engine.config import load_config

        self.config = load_config(raw=raw, overrides=list(overrides), check_environment=False, check_plugins=False)
        key = secrets.token_bytes(16)
        self._listener = Listener(("127.0.0.1", 0), authkey=key)
        host, port = self._listener.address
        from llmrl.engine.rendezvous import free_port
        from llmrl.launch.command import RunOptions, deepspeed_command, deepspeed_executable

        options = RunOptions(config=self.config_path, module="llmrl.engine.testing_proxy",
                             script_args=[f"{host}:{port}", key.hex()], overrides=list(overrides),
                             master_port=free_port())
        self.command = deepspeed_command(options, self.config.world_size, deepspeed_executable())
        self.log_path = self.workdir / "run.log"
        self._log = open(self.log_path, "w")
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.process = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT, env=full_env,
                                        start_new_session=True, cwd=os.getcwd(), stdin=subprocess.DEVNULL)
        self._conn = self._accept(startup_timeout)
        self._conn.send(caller_kwargs or {})
        status, value = self._recv(startup_timeout)
        if status != "ok":
            self.kill()
            raise value
        self.info = value

    def _accept(self, timeout: float):
        import threading
        import time

        box: list = []
        thread = threading.Thread(target=lambda: box.append(self._listener.accept()), daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout
        while thread.is_alive() and time.monotonic() < deadline and self.process.poll() is None:
            thread.join(0.2)
        if not box:
            self.kill()
            raise RuntimeError(f"the run did not start (exit code {self.process.poll()}); log:\n{self.log}")
        from llmrl.engine.testing_proxy import _Channel

        return _Channel(box[0])

    def _recv(self, timeout: float | None = None):
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._conn.poll(0.2):
            if self.process.poll() is not None and not self._conn.poll(0.5):
                raise RuntimeError(f"the run exited with code {self.process.returncode}; log:\n{self.log}")
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"no answer from the run within {timeout} s; log:\n{self.log}")
        try:
            return self._conn.recv()
        except (EOFError, ConnectionError) as err:
            raise self._ended(err) from err

    def _ended(self, err: BaseException) -> RuntimeError:
        """The error for a client that went away (the launcher ends every rank when one dies)."""
        import subprocess

        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            pass
        return RuntimeError(f"the run's client closed the connection ({type(err).__name__}; run exit code "
                            f"{self.process.poll()}); log:\n{self.log}")

    def _send(self, message) -> None:
        try:
            self._conn.send(message)
        except (EOFError, ConnectionError) as err:
            raise self._ended(err) from err

    def call(self, method: str, *args, timeout: float | None = 600.0, **kwargs):
        self._send(("call", method, args, kwargs))
        status, value = self._recv(timeout)
        if status != "ok":
            raise value
        return value

    def many(self, method: str, calls: list[tuple[tuple, dict]], timeout: float | None = 600.0):
        """Start ``method_async`` once per ``(args, kwargs)`` at the same time; their results in order."""
        self._send(("many", method, calls))
        status, value = self._recv(timeout)
        if status != "ok":
            raise value
        return value

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *args, **kwargs: self.call(name, *args, **kwargs)

    def exit_script(self, code: int) -> None:
        """Make the client script exit with ``code`` (without closing the Caller)."""
        self._send(("exit", code))
        self._recv(60)

    def raise_in_script(self, message: str) -> None:
        self._send(("raise", message))
        self._recv(60)

    def wait(self, timeout: float = 120.0) -> int:
        import subprocess

        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def close(self, timeout: float = 120.0) -> int:
        """Close the Caller (servers stop cleanly) and wait for every process; the launcher's exit code."""
        if self.process.poll() is None:
            try:
                self.call("close", timeout=timeout)
            except (RuntimeError, EOFError, OSError):
                pass
        code = self.wait(timeout)
        self._cleanup()
        return code

    def kill(self) -> None:
        import signal

        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.process.wait(30)
        except Exception:  # noqa: BLE001
            pass
        self._cleanup()

    def _cleanup(self) -> None:
        for closer in (getattr(self, "_conn", None), self._listener, self._log):
            try:
                if closer is not None:
                    closer.close()
            except OSError:
                pass

    def leftover_processes(self) -> list[int]:
        """PIDs of processes of this run still alive (there should be none after it ends)."""
        import psutil

        alive = []
        for proc in psutil.process_iter(["pid", "cmdline", "status"]):
            try:
                if self.config_path in " ".join(proc.info["cmdline"] or []) and proc.info["status"] != "zombie":
                    alive.append(proc.info["pid"])
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return alive

    @property
    def log(self) -> str:
        try:
            self._log.flush()
        except (OSError, ValueError):
            pass
        return self.log_path.read_text(errors="replace")

    def __enter__(self) -> LiveRun:
        return self

    def __exit__(self, *exc) -> None:
        if self.process.poll() is None:
            try:
                self.close(timeout=60)
            except Exception:  # noqa: BLE001
                self.kill()
