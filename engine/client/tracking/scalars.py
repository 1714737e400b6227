"""The scalars a run tracks, as pure functions: a script's metrics checked and flattened, the replicas' update
statistics averaged, and the servers' ``stats`` replies reduced to memory, cache and request figures per LLM.

Names are ``/``-joined paths (a nested dict ``{"reward": {"mean": 1}}`` becomes ``reward/mean``). This module writes
nothing and asks the servers nothing: :mod:`llmrl.engine.client.tracking.tracker` does.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping

from llmrl.engine.errors import InvalidArgument, InvalidArgumentType

MB = float(1 << 20)
# requests that say nothing about the work a server does (the tracker's own stats requests among them)
_BOOKKEEPING = ("stats", "ping", "setup")


def as_number(value) -> float | None:
    """``value`` as a float when it is one number (int, float, bool, a NumPy scalar, a one-element tensor or
    array), else None."""
    if isinstance(value, numbers.Real):
        return float(value)
    item = getattr(value, "item", None)
    if callable(item):
        try:
            value = item()
        except (ValueError, RuntimeError, TypeError):  # more than one element
            return None
        return float(value) if isinstance(value, numbers.Real) else None
    return None


def flatten(metrics: Mapping, prefix: str = "", strict: bool = True) -> dict[str, float]:
    """The numbers of a (nested) mapping, keyed by ``/``-joined names.

    Args:
        metrics: names to numbers, or to mappings of the same kind.
        prefix: put before every name (``prefix/name``).
        strict: refuse a name that is not a non-empty string and a value that is not a number (a script's
            metrics); otherwise skip them (an updater's statistics may hold lists and strings).

    Raises:
        InvalidArgumentType: with ``strict``, a bad name or value, named.
    """
    if not isinstance(metrics, Mapping):
        raise InvalidArgumentType(f"metrics must be a dict of names to numbers, got {type(metrics).__name__}")
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if not (isinstance(key, str) and key):
            if strict:
                raise InvalidArgumentType(f"metric names must be non-empty strings, got {key!r}"
                                          + (f" under {prefix!r}" if prefix else ""))
            key = str(key)
        name = f"{prefix}/{key}" if prefix else key
        if isinstance(value, Mapping):
            out.update(flatten(value, name, strict))
            continue
        number = as_number(value)
        if number is None:
            if strict:
                raise InvalidArgumentType(f"metric {name!r} must be a number (int, float, bool, or a one-element "
                                          f"tensor or array), got {type(value).__name__}; nested dicts are "
                                          "flattened with '/'")
            continue
        out[name] = number
    return out


def check_step(step) -> int | None:
    """A step given by a script: None or an integer >= 0."""
    if step is None:
        return None
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise InvalidArgumentType(f"step must be an integer (or None for the current step), got {type(step).__name__}")
    if step < 0:
        raise InvalidArgument(f"step must be >= 0, got {step}")
    return int(step)


def update_scalars(stats, samples: int | None, seconds: float) -> dict[str, float]:
    """What an update call reports: each statistic's mean over the replicas that report it (numbers only; nested
    dicts flattened), ``replicas`` (how many dicts were averaged), the call's ``seconds`` and, when the number of
    samples is known, ``samples`` and ``samples_per_second``.

    ``stats``: ``update``'s list of per-replica dicts, or one dict (``optim_step``'s).
    """
    replicas = [stats] if isinstance(stats, Mapping) else [s for s in stats or () if isinstance(s, Mapping)]
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for one in replicas:
        for name, value in flatten(one, strict=False).items():
            sums[name] = sums.get(name, 0.0) + value
            counts[name] = counts.get(name, 0) + 1
    out = {name: sums[name] / counts[name] for name in sums}
    out["replicas"] = float(len(replicas))
    out["seconds"] = float(seconds)
    if samples is not None:
        out["samples"] = float(samples)
        if seconds > 0:
            out["samples_per_second"] = samples / seconds
    return out


def _most(totals: dict[str, float], name: str, value, scale: float = 1.0) -> None:
    """Keep the largest ``value / scale`` seen under ``name`` (values that are not numbers are left out)."""
    number = as_number(value)
    if number is not None:
        totals[name] = max(totals.get(name, float("-inf")), number / scale)


def server_totals(stats: Mapping[int, Mapping], llm_of: Mapping[int, str]) -> dict[str, dict[str, float]]:
    """Per LLM, from every rank's ``stats`` reply: the largest resident set, peak, CUDA allocation and CUDA peak
    over its ranks (MB), the largest key/value cache (MB), the cache's lookups and hits summed over its ranks
    (tokens), and the requests its busiest rank received (bookkeeping requests left out)."""
    out: dict[str, dict[str, float]] = {}
    for rank, reply in stats.items():
        llm = llm_of.get(rank)
        if llm is None or not isinstance(reply, Mapping):
            continue
        totals = out.setdefault(llm, {})
        for key in ("rss", "peak_rss", "cuda_allocated", "cuda_peak"):
            _most(totals, f"{key}_mb", reply.get(key), MB)
        cache = reply.get("kv_cache")
        if isinstance(cache, Mapping):
            _most(totals, "kv_cache_mb", cache.get("bytes"), MB)
            for key in ("lookup_tokens", "hit_tokens"):
                totals[f"kv_cache_{key}"] = totals.get(f"kv_cache_{key}", 0.0) + (as_number(cache.get(key)) or 0.0)
        requests = reply.get("requests")
        if isinstance(requests, Mapping):
            _most(totals, "requests", sum(as_number(n) or 0.0 for kind, n in requests.items()
                                          if kind not in _BOOKKEEPING))
    return out


def server_scalars(totals: dict[str, dict[str, float]], before: dict[str, dict[str, float]] | None,
                   seconds: float | None) -> dict[str, dict[str, float]]:
    """Per LLM, the scalars of a servers' report: ``rss_mb``, ``peak_rss_mb``, ``cuda_allocated_mb``,
    ``cuda_peak_mb`` and ``kv_cache_mb`` (the largest over its ranks), ``kv_cache_hit_rate`` (hit tokens over
    looked-up tokens since the ``before`` report, or since the start; absent when no token was looked up), and
    ``requests_per_second`` (its busiest rank's, over the ``seconds`` since ``before``).

    ``totals`` and ``before``: :func:`server_totals` of this report and of the previous one.
    """
    out = {}
    for llm, now in totals.items():
        then = (before or {}).get(llm, {})
        scalars = {k: v for k, v in now.items() if k.endswith("_mb")}
        looked = now.get("kv_cache_lookup_tokens", 0.0) - then.get("kv_cache_lookup_tokens", 0.0)
        if looked > 0:
            scalars["kv_cache_hit_rate"] = (now["kv_cache_hit_tokens"] - then.get("kv_cache_hit_tokens", 0.0)) / looked
        if seconds and "requests" in now and "requests" in then:
            scalars["requests_per_second"] = (now["requests"] - then["requests"]) / seconds
        out[llm] = scalars
    return out
