"""The ``tokenize`` request kind, behind ``Caller.tokenize``: the token plan the server would score, for users
debugging tokenisation (boundary merges, BOS, what exactly a candidate's log-prob sums over).

Client half: the whole call goes to the first rank of the LLM (tokenising runs no model). Server half: the
backend plans the inputs exactly as ``score`` would and the plan is returned as plain Python: per context its
token ids and token strings, and per candidate the ids that are scored and how many of the context's last
tokens the candidate's first characters merged with.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

from llmrl.engine.requests.base import Kind, Run

NAME = "tokenize"


@dataclass(frozen=True)
class TokenizeRequest:
    contexts: list[str | list[int]]  # text, or token ids used as given
    candidates: list[list[str | list[int]]] | None = None


def send(run: Run, llm: str, request: TokenizeRequest) -> Future:
    leader = run.replicas(llm)[0][0]
    return run.submit(NAME, [([leader], request)], lambda values: values[leader])


def handle(replica, request: TokenizeRequest):
    plan = replica.backend.tokenize(request)
    tokenizer = replica.backend.tokenizer
    out = []
    for ctx in plan.contexts:
        entry = {"ids": list(ctx.ids), "tokens": tokenizer.convert_ids_to_tokens(ctx.ids), "candidates": []}
        for cand in ctx.candidates:
            scored = cand.rest[cand.first_scored:]
            merged = 0 if plan.kind == "seq2seq" else len(ctx.ids) - (ctx.shared + cand.first_scored)
            entry["candidates"].append({"ids": scored, "tokens": tokenizer.convert_ids_to_tokens(scored),
                                        "merged_context_tokens": merged})
        out.append(entry)
    return out


KIND = Kind(name=NAME, payload=TokenizeRequest, send=send, handle=handle, backend_method="tokenize",
            caller_methods=("tokenize",))
