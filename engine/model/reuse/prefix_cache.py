"""A key/value cache that lives across scoring calls: a radix tree over token ids, bounded by a byte cap (LRU).

Consecutive ``score`` calls of an RL episode repeat a static header and, with history-based prompts, the whole
previous context. :class:`PrefixKVCache` keeps the attention keys and values of every context prefix a causal
model has encoded, keyed by its token ids, so that the next call encodes only the tokens after the longest
cached prefix (as SGLang's RadixAttention does for serving). Each tree edge holds a run of tokens and, per
layer, their keys and values (``[kv_heads, tokens, head_dim]``); a partial match splits an edge. Trees are kept
per namespace (the LoRA adapter the keys were computed with): keys of one adapter never serve another.

The cap is counted in *model* bytes per token (layers x 2 x key/value heads x head dim x element size, for the
whole model), not in the bytes this rank holds: tensor-parallel ranks hold different shares of the heads, and
must nevertheless keep exactly the same entries, or they would encode different numbers of tokens and their
collectives would not line up. Eviction order comes from a logical clock for the same reason.

Correctness rules the callers keep: only no-grad scoring reads or fills the cache; every change of weights
clears it (:meth:`clear`), or, when only the layers from some depth up changed (LoRA on the top layers, the
``freeze`` initializer), drops the keys and values of those layers alone (:meth:`keep_layers_below`): the entries
are then *stale* and :meth:`refresh` recomputes their top layers (from hidden states the frozen trunk kept)
before anything reads them (reading a stale entry raises); the last token of every prefix is always encoded again
(:meth:`match` caps the match), so its logits and hidden states come from a real pass.

This module is a data structure over tensors: it runs no model and knows nothing about requests.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

# Per layer: tensors whose dim 1 runs over tokens (keys, values [kv_heads, tokens, head_dim]).
KV = list[tuple[torch.Tensor, ...]]


@dataclass(eq=False)
class _Node:
    tokens: tuple[int, ...]
    kv: KV
    parent: _Node | None
    children: dict[int, _Node] = field(default_factory=dict)
    last_used: int = 0
    stale: bool = False  # the layers from the cache's ``stale_from`` up are dropped (None) until refreshed

    def split(self, at: int) -> _Node:
        """Cut this edge after ``at`` tokens: a new node holds the head and becomes this node's parent. Each half is
        copied into storage of its own: a view would keep the whole edge alive after the other half is evicted."""
        head = _Node(self.tokens[:at], _own(self.kv, 0, at), self.parent, last_used=self.last_used, stale=self.stale)
        self.parent.children[self.tokens[0]] = head
        self.tokens = self.tokens[at:]
        self.kv = _own(self.kv, at, None)
        self.parent = head
        head.children[self.tokens[0]] = self
        return head


def _own(kv: KV, start: int, end: int | None) -> KV:
    """Tokens ``start:end`` of every layer's tensors, each a contiguous copy that owns exactly its bytes."""
    return [None if entry is None else tuple(t[:, start:end].clone(memory_format=torch.contiguous_format)
                                             for t in entry) for entry in kv]


class PrefixKVCache:
    """Keys and values of token prefixes, per namespace, within ``cap_bytes`` (model bytes, see the module doc)."""

    def __init__(self, cap_bytes: int, bytes_per_token: int):
        if cap_bytes <= 0 or bytes_per_token <= 0:
            raise ValueError("a prefix cache needs a positive cap and a positive size per token")
        self.cap_bytes = int(cap_bytes)
        self.bytes_per_token = int(bytes_per_token)
        self.roots: dict[str | None, _Node] = {}
        self.clock = 0
        self.tokens = 0  # tokens held, all namespaces
        self.lookups = 0
        self.lookup_tokens = 0
        self.hit_tokens = 0
        self.evicted_tokens = 0
        self.clears = 0
        self.partial_clears = 0  # :meth:`keep_layers_below` calls
        self.stale_from: int | None = None  # the first layer dropped by the last keep_layers_below
        self.refreshed_tokens = 0
        self.dropped_stale_tokens = 0
        self.generation = {"prompts": 0, "prompt_tokens": 0, "encoded_tokens": 0}  # generation_prefix counts these

    # ------------------------------------------------------------------ reading

    def match(self, namespace: str | None, tokens: Sequence[int], limit: int | None = None) -> tuple[int, KV | None]:
        """The longest cached prefix of ``tokens`` (at most ``limit`` tokens) and its keys and values, concatenated
        per layer (fresh tensors: later evictions do not touch them). ``(0, None)`` when nothing matches."""
        length, pieces = self.match_pieces(namespace, tokens, limit)
        if length == 0:
            return 0, None
        joined = [tuple(torch.cat([p[layer][i] for p in pieces], dim=1) for i in range(len(pieces[0][layer])))
                  for layer in range(len(pieces[0]))]
        return length, joined

    def match_pieces(self, namespace: str | None, tokens: Sequence[int], limit: int | None = None
                     ) -> tuple[int, list[KV]]:
        """:meth:`match` without the copy: the matched run of each tree edge along the path, in order (views of
        the cache's tensors, which are never written in place: later splits and evictions leave them valid)."""
        self.clock += 1
        limit = len(tokens) if limit is None else min(limit, len(tokens))
        self.lookups += 1
        self.lookup_tokens += limit
        path, length = self._walk(namespace, tokens, limit)
        for node in path:
            node.last_used = self.clock
        self.hit_tokens += length
        pieces = []
        taken = 0
        for node in path:
            take = min(len(node.tokens), length - taken)
            if take > 0:
                if node.stale:
                    raise RuntimeError("a stale cache entry was read before it was refreshed")
                pieces.append([tuple(t[:, :take] for t in entry) for entry in node.kv])
            taken += take
        return length, pieces

    def held(self, namespace: str | None, tokens: Sequence[int], limit: int | None = None) -> int:
        """How many leading tokens of ``tokens`` (at most ``limit``) are held: no copy, no statistics, no change
        of eviction order."""
        limit = len(tokens) if limit is None else min(limit, len(tokens))
        return self._walk(namespace, tokens, limit)[1]

    def fresh_length(self, namespace: str | None, tokens: Sequence[int], limit: int | None = None) -> int:
        """How many leading tokens of ``tokens`` (at most ``limit``) are held in entries that are not stale: no copy,
        no statistics, no change of eviction order."""
        limit = len(tokens) if limit is None else min(limit, len(tokens))
        path, length = self._walk(namespace, tokens, limit)
        start = 0
        for node in path:
            if node.stale:
                return start
            start += len(node.tokens)
        return length

    def _walk(self, namespace, tokens: Sequence[int], limit: int) -> tuple[list[_Node], int]:
        """The nodes along ``tokens[:limit]`` (the last one possibly matched only in part) and the length matched."""
        node = self.roots.get(namespace)
        path: list[_Node] = []
        length = 0
        while node is not None and length < limit:
            child = node.children.get(tokens[length])
            if child is None:
                break
            same = 0
            edge = child.tokens
            while same < len(edge) and length + same < limit and edge[same] == tokens[length + same]:
                same += 1
            path.append(child)
            length += same
            if same < len(edge):
                break
            node = child
        return path, length

    # ------------------------------------------------------------------ writing

    def insert(self, namespace: str | None, tokens: Sequence[int], kv_of: Callable[[int, int], KV]) -> None:
        """Hold the keys and values of ``tokens``; ``kv_of(start, end)`` gives those of ``tokens[start:end]`` (only
        the part not cached yet is asked for). Least recently used entries are then evicted down to the cap;
        the entry just inserted is kept whole unless it alone exceeds the cap."""
        if not tokens:
            return
        self.clock += 1
        root = self.roots.setdefault(namespace, _Node((), [], None))
        node, length = root, 0
        while length < len(tokens):
            child = node.children.get(tokens[length])
            if child is None:
                kv = [tuple(t.clone(memory_format=torch.contiguous_format) for t in entry)
                      for entry in kv_of(length, len(tokens))]
                child = _Node(tuple(tokens[length:]), kv, node, last_used=self.clock)
                node.children[tokens[length]] = child
                self.tokens += len(child.tokens)
                break
            same = 0
            while same < len(child.tokens) and length + same < len(tokens) and \
                    child.tokens[same] == tokens[length + same]:
                same += 1
            if same < len(child.tokens):
                child = child.split(same)
            child.last_used = self.clock
            node, length = child, length + same
        self._evict(keep=self.clock)

    def _evict(self, keep: int) -> None:
        """Drop least recently used leaves until the cap holds; entries used at clock ``keep`` go last."""
        while self.tokens * self.bytes_per_token > self.cap_bytes:
            leaves = [n for root in self.roots.values() for n in _leaves(root) if n.parent is not None]
            if not leaves:
                return
            victim = min(leaves, key=lambda n: (n.last_used == keep, n.last_used))
            over = self.tokens - self.cap_bytes // self.bytes_per_token
            if victim.last_used == keep and len(victim.tokens) > over:
                keep_tokens = len(victim.tokens) - over  # trim the newest entry's tail rather than drop it
                victim.tokens = victim.tokens[:keep_tokens]
                victim.kv = _own(victim.kv, 0, keep_tokens)
                self.tokens -= over
                self.evicted_tokens += over
                return
            del victim.parent.children[victim.tokens[0]]
            self.tokens -= len(victim.tokens)
            self.evicted_tokens += len(victim.tokens)

    def clear(self) -> None:
        """Forget everything (the weights changed); counters are kept."""
        self.roots.clear()
        self.tokens = 0
        self.clears += 1

    def forget(self, namespace: str | None) -> None:
        """Forget one namespace's entries (its adapter's weights were replaced or deleted)."""
        root = self.roots.pop(namespace, None)
        if root is not None:
            self.tokens -= sum(len(n.tokens) for n in _nodes(root) if n.parent is not None)

    def keep_layers_below(self, depth: int) -> None:
        """The weights of layers ``depth`` and up changed, not those below: drop every entry's keys and values of
        those layers and mark it stale, to be refreshed (:meth:`refresh`) before it is read. Entries keep counting
        for their whole size against the cap (they are whole again once refreshed)."""
        for root in self.roots.values():
            for node in _nodes(root):
                if node.parent is not None:
                    node.kv = node.kv[:depth] + [None] * (len(node.kv) - depth)
                    node.stale = True
        self.stale_from = depth
        self.partial_clears += 1

    def refresh(self, namespace: str | None, prefixes: Sequence[Sequence[int]],
                compute: Callable[[list[list[int]]], list[KV | None]]) -> None:
        """Make the entries along ``prefixes`` whole again (only stale ones are touched). ``compute(paths)`` gets,
        for each path of stale entries (token ids from the start of a sequence, up to the end of the prefix; a
        path that another one extends is left out, the longer one covers it), the keys and values of its layers
        from ``stale_from`` up (``[kv_heads, len(path), head_dim]`` per layer), or None for a path it cannot
        compute. Every computed path is filled in first; then, along each path that could not be computed, the
        first entry still stale is dropped with what hangs below it (later lookups miss there)."""
        for tokens in prefixes:  # a stale entry a prefix ends inside is split there: only its head is refreshed
            path, length = self._walk(namespace, tokens, len(tokens))
            end = sum(len(n.tokens) for n in path)
            if path and path[-1].stale and end > length:
                path[-1].split(len(path[-1].tokens) - (end - length))
        todo: dict[int, list[tuple[_Node, int]]] = {}  # a path's last entry -> its entries and where each starts
        inner: set[int] = set()  # entries some path goes on past
        for tokens in prefixes:  # (after every split: each path now ends at an edge's end)
            path, _ = self._walk(namespace, tokens, len(tokens))
            if any(node.stale for node in path):
                starts = itertools.accumulate((len(n.tokens) for n in path[:-1]), initial=0)
                todo.setdefault(id(path[-1]), list(zip(path, starts)))
                inner.update(id(node) for node in path[:-1])
        paths = [todo[last] for last in todo if last not in inner]  # one that another path extends: covered by it
        if not paths:
            return
        failed = []
        for path, kv in zip(paths, compute([[t for node, _ in path for t in node.tokens] for path in paths])):
            if kv is None:
                failed.append(path)
                continue
            for node, start in path:
                if not node.stale:
                    continue
                end = start + len(node.tokens)
                for offset, entry in enumerate(kv):
                    node.kv[self.stale_from + offset] = tuple(t[:, start:end].clone() for t in entry)
                node.stale = False
                self.refreshed_tokens += len(node.tokens)
        for path in failed:
            first = next((node for node, _ in path if node.stale), None)
            if first is not None and self._attached(first):
                self._drop(first)

    def _attached(self, node: _Node) -> bool:
        while node.parent is not None:
            if node.parent.children.get(node.tokens[0]) is not node:
                return False
            node = node.parent
        return node in self.roots.values()

    def _drop(self, node: _Node) -> None:
        """Remove ``node`` and everything below it."""
        del node.parent.children[node.tokens[0]]
        dropped = sum(len(n.tokens) for n in _nodes(node))
        self.tokens -= dropped
        self.dropped_stale_tokens += dropped

    # ------------------------------------------------------------------ reporting

    def held_bytes(self) -> int:
        """Bytes this rank's keys and values really keep alive: the sizes of the distinct storages under them (every
        stored tensor owns its storage, so this is also the sum of their own sizes)."""
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for root in self.roots.values()
                    for node in _nodes(root) for entry in node.kv if entry is not None for t in entry}
        return sum(storages.values())

    def stats(self) -> dict:
        return {
            "cap_bytes": self.cap_bytes,
            "bytes": self.tokens * self.bytes_per_token,
            "rank_bytes": self.held_bytes(),
            "tokens": self.tokens,
            "namespaces": len(self.roots),
            "lookups": self.lookups,
            "lookup_tokens": self.lookup_tokens,
            "hit_tokens": self.hit_tokens,
            "hit_rate": self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0,
            "evicted_tokens": self.evicted_tokens,
            "clears": self.clears,
            "partial_clears": self.partial_clears,
            "refreshed_tokens": self.refreshed_tokens,
            "dropped_stale_tokens": self.dropped_stale_tokens,
            "generation": dict(self.generation),
        }


class CacheUse(NamedTuple):
    """What a scoring pass reads and fills: a cache, and the namespace (adapter) its keys belong to."""

    cache: PrefixKVCache
    namespace: str | None


def _nodes(root: _Node):
    stack = [root]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())


def _leaves(root: _Node):
    return (n for n in _nodes(root) if not n.children)


def model_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes of keys and values one token takes in the whole model (all layers, all key/value heads)."""
    text = config.get_text_config()
    layers = text.num_hidden_layers
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return layers * 2 * kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()
