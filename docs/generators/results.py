"""The measured results (``docs/reference/results.md``), rendered from the measurement files in ``docs/``: the demos'
``*-summary.json``, the scoring benchmark's ``benchmark-results.json``, the GRPO step's ``grpo-step-*.json`` and the
decoding benchmark's ``decoding-*.json``.

Each table says what was measured and, per file, the date, hardware and commit: those the file records (the
examples' ``summary.json`` carry a ``provenance`` section, :func:`llmrl.engine.provenance.run_provenance`), else
those ``docs/results-provenance.json`` records for it (the commit that recorded the file, and its date), else "not
recorded". It measures nothing and reads no other file.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent
NOT_RECORDED = "not recorded"


def _load(name: str) -> dict:
    """The file's fields, its own ``provenance`` section over them, over what ``results-provenance.json`` records."""
    data = json.loads((DOCS / name).read_text())
    recorded = json.loads((DOCS / "results-provenance.json").read_text())["files"].get(name, {})
    own = data.get("provenance") if isinstance(data.get("provenance"), dict) else {}
    return {**recorded, **data, **own}


def _files(pattern: str) -> list[str]:
    return sorted(p.name for p in DOCS.glob(pattern))


def _num(value, digits: int = 3) -> str:
    if isinstance(value, bool) or value is None:
        return {True: "yes", False: "no", None: "–"}[value]
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 1e-3 and value else f"{value:.{digits}f}".rstrip("0").rstrip(".")
    return str(value).replace("|", "\\|")


def _table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(_num(c) for c in row) + " |" for row in rows]
    return lines + [""]


def provenance(data: dict) -> dict[str, str]:
    """Date, hardware and commit as the file records them (top level or in a ``throughput`` section)."""
    found = {**data.get("throughput", {}), **data} if isinstance(data.get("throughput"), dict) else data
    hardware = found.get("device") or found.get("hardware") or ("cpu" if found.get("devices") == "cpu" else None)
    if hardware == "cpu":
        hardware = "CPU (model not recorded)"
    if hardware and "threads" in found:
        hardware += f", {found['threads']} threads"
    elif not hardware and "threads" in found:
        hardware = f"CPU, {found['threads']} threads (model not recorded)"
    elif not hardware and "matmul_gflops_2_threads" in found:
        hardware = "CPU, 2 threads (model not recorded)"
    return {"date": str(found.get("date") or NOT_RECORDED), "hardware": str(hardware or NOT_RECORDED),
            "commit": str(found.get("commit") or NOT_RECORDED)}


def _provenance_line(data: dict) -> str:
    p = provenance(data)
    versions = ", ".join(f"{k} {data[k]}" for k in ("torch", "transformers", "peft", "deepspeed", "trl") if k in data)
    return (f"Date: {p['date']}. Hardware: {p['hardware']}. Commit: {p['commit']}."
            + (f" Versions: {versions}." if versions else ""))


def _command(data: dict) -> list[str]:
    match = re.search(r"python3? -m [^()]*", str(data.get("command", "")))
    return [f"Command: `{match.group(0).strip()}`", ""] if match else []


def _outcome(block) -> str:
    blocks = block if isinstance(block, list) else [block]
    parts = []
    for b in blocks:
        key = next((k for k in ("success_rate", "mean_reward", "rate") if k in b), None)
        if key is None:
            continue
        ci = b.get("ci95")
        span = f" [{_num(ci[0])}, {_num(ci[1])}]" if isinstance(ci, list) and len(ci) == 2 else ""
        label = f"{b['label']}: " if len(blocks) > 1 and "label" in b else ""
        parts.append(f"{label}{key.replace('_', ' ')} {_num(b[key])}{span}")
    return "; ".join(parts)


def demos() -> list[str]:
    lines = ["## Training demos", "",
             "Each demo trains a small model and evaluates it before and after on held-out episodes or prompts "
             "(95% confidence intervals in brackets). Curves: the `*-curve.png` next to each file.", ""]
    rows = []
    for name in _files("*-summary.json"):
        data = _load(name)
        p = provenance(data)
        rows.append([f"`{name}`", _outcome(data["before"]), _outcome(data["after"]),
                     data.get("improvement_significant"), round(data.get("wall_seconds") or 0) or None,
                     p["date"], p["hardware"], p["commit"]])
    return lines + _table(["file", "before", "after", "significant", "wall s", "date", "hardware", "commit"], rows)


def scoring() -> list[str]:
    data = _load("benchmark-results.json")
    lines = ["## Scoring, generation and updates on a CPU", "",
             f"`benchmark-results.json`: model `{data['model']}` ({data['parameters']:,} parameters), each workload "
             f"against its compute limit (its FLOPs at the best measured matmul rate, "
             f"{_num(data['matmul GFLOP/s'], 4)} GFLOP/s) and, where measured, a naive Hugging Face loop. "
             f"{_provenance_line(data)}", ""]
    for row in data["rows"]:
        lines += [f"### {_num(row['workload'])}", ""]
        lines += _table(["measure", "value"], [[key, _num(value, 4)] for key, value in row.items()
                                               if key != "workload"])
    return lines


def _step_sections(data: dict) -> list[tuple[dict, str, dict]]:
    """``(settings, section name, section)`` for every "N new tokens" section, nested or not."""
    out = []
    for key, value in data.items():
        if key.endswith("new tokens") and isinstance(value, dict):
            out.append((data, key, value))
        elif isinstance(value, dict):
            out += _step_sections(value)
    return out


def grpo_steps() -> list[str]:
    lines = ["## GRPO step", "",
             "`benchmarks/grpo_step.py`: one GRPO step (generate, score, update) per path; `now` is llmrl, `trl` "
             "TRL's GRPOTrainer, `plain` a plain Hugging Face loop. Seconds per step; the ratio is the baseline's "
             "median step over the path's (higher is faster).", ""]
    for name in _files("grpo-step-*.json"):
        data = _load(name)
        lines += [f"### `{name}`", "", _provenance_line(data), ""] + _command(data)
        rows = []
        for settings, section, paths in _step_sections(data):
            ratios = paths.get("ratios (baseline's median step / path's)", {})
            setup = (f"{settings.get('shape')} {settings.get('dtype')}, {settings.get('prompts')} prompts x "
                     f"{settings.get('samples')} samples, {section}")
            for path, result in paths.items():
                if isinstance(result, dict) and "median step" in result:
                    rows.append([setup, path, _num(result["first step"]), _num(result["median step"]),
                                 result.get("peak CUDA MiB"), _num(ratios.get(path))])
        lines += _table(["setting", "path", "first step s", "median step s", "peak CUDA MiB", "ratio"], rows)
    return lines


def _exactness(block) -> list[str]:
    """The agreement with Hugging Face's own decoding the file records (greedy sequences, log-prob gaps)."""
    if not isinstance(block, dict):
        return []
    flat = [[section, key, value] for section, values in block.items() if isinstance(values, dict)
            for key, value in values.items()] + [["", key, value] for key, value in block.items()
                                                 if not isinstance(value, dict)]
    rows = [[(f"{section}: " if section else "") + key, _num(value, 4)] for section, key, value in flat
            if not isinstance(value, (dict, list))]
    return ["Exactness against Hugging Face:", ""] + _table(["check", "value"], rows) if rows else []


def decoding() -> list[str]:
    lines = ["## Decoding", "",
             "`benchmarks/decoding.py`: sampling with a LoRA adapter, in seconds per batch (`/ plain`: the time over "
             "plain Hugging Face `generate` without an adapter).", ""]
    for name in _files("decoding-*.json"):
        data = _load(name)
        run = data.get("throughput", data)
        lines += [f"### `{name}`", "", _provenance_line(run) if run is not data else _provenance_line(data), ""]
        lines += _command(data)
        lines.append(f"Model {run.get('shape')}, {run.get('dtype')}, sampling settings: {run.get('sampling', '–')}.")
        lines.append("")
        rows = []
        for section, values in run.items():
            if not (isinstance(values, dict) and "tokens" in section):
                continue
            for label, seconds in values.items():
                if isinstance(seconds, (int, float)) and not label.endswith("/ plain"):
                    ratio = values.get(f"{label} / plain", values.get(f"{label.split(' (')[0]} / plain"))
                    rows.append([section, label, _num(seconds), _num(ratio)])
        lines += _table(["batch", "what", "seconds", "/ plain"], rows)
        lines += _exactness(run.get("exactness", data.get("exactness")))
    return lines


def render() -> str:
    lines = ["# Measured results", "",
             "<!-- Generated by docs/generators/results.py from docs/*.json: run `python docs/generate.py` after a "
             "measurement file changes. -->", "",
             "The numbers below are read from the measurement files in the repository's `docs/` folder. Each carries "
             "the date, hardware and commit of its measurement: those the file records (the examples write a "
             "`provenance` section into their `summary.json`), else those `docs/results-provenance.json` records "
             "for it (the commit that recorded the file, and its date); what neither records is marked so.", ""]
    lines += demos() + scoring() + grpo_steps() + decoding()
    return "\n".join(lines).rstrip() + "\n"
