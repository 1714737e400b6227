"""Run a planned batch of a seq2seq model (T5, BART): the encoder once per batch (when the plan says so), its output
reused by the decoder rows of every candidate; decoder position ``t`` (reading the start token and the
candidate's first ``t`` tokens) predicts the candidate's token ``t``. It knows nothing about processes or requests.
"""

from __future__ import annotations

import torch

from llmrl.engine.model.scoring.planning import COMPLETION, context_offsets, pad_rows, row_inputs
from llmrl.engine.model.scoring.results import BatchResult, Pick, TokenSink, at, batch_result, needed_logprobs


def run_seq2seq(model, plan, batch, needs, pad_id, device, start_id) -> BatchResult:
    from transformers.modeling_outputs import BaseModelOutput

    ctxs = [plan.contexts[i] for i in batch.contexts]
    offsets = context_offsets(plan, batch)
    n_cand = offsets[-1]
    want_hidden, layers = needs.hidden, needs.layers
    enc_ids, enc_mask = pad_rows([c.ids for c in ctxs], pad_id, left=False, device=device)
    encoded = (model.get_encoder()(input_ids=enc_ids, attention_mask=enc_mask, return_dict=True)
               if batch.encoder_pass else None)
    touched = [] if encoded is None else [encoded.last_hidden_state]
    sink = TokenSink(needs)
    counts = torch.zeros(n_cand, dtype=torch.long)
    context_hidden = [None] * len(ctxs)
    candidate_hidden = [None] * n_cand
    for chunk in batch.chunks:
        inputs = [[start_id] + row_inputs(plan, batch.contexts[a], j, needs) for a, j in chunk]
        dec_ids, dec_mask = pad_rows(inputs, pad_id, left=False, device=device)
        row_ctx = torch.tensor([a for a, _ in chunk], device=device)
        kwargs = {"attention_mask": enc_mask[row_ctx], "decoder_input_ids": dec_ids,
                  "decoder_attention_mask": dec_mask, "output_hidden_states": want_hidden, "use_cache": False}
        if encoded is not None:
            kwargs["encoder_outputs"] = BaseModelOutput(last_hidden_state=encoded.last_hidden_state[row_ctx])
        else:
            kwargs["input_ids"] = enc_ids[row_ctx]
        out = model(**kwargs)
        touched.append(out.logits)
        rows, positions, targets, cand_of_token = [], [], [], []
        for r, (a, j) in enumerate(chunk):
            if j == COMPLETION:
                continue
            rest = ctxs[a].candidates[j].rest
            for t in range(len(rest)):
                rows.append(r)
                positions.append(t)
                targets.append(rest[t])
                cand_of_token.append(offsets[a] + j)
            counts[offsets[a] + j] += len(rest)
        if targets:
            logits = out.logits[torch.tensor(rows, device=device), torch.tensor(positions, device=device)]
            targets = torch.tensor(targets, device=device)
            # Decoder position t (reading the start token and rest[:t]) predicts rest[t].
            hidden = (at(out.decoder_hidden_states, layers, torch.tensor(rows, device=device),
                          torch.tensor(positions, device=device)) if needs.token_hidden else None)
            logprobs, entropy = needed_logprobs(needs, logits, targets)
            sink.add(logprobs, cand_of_token, positions, targets, logits, entropy, hidden=hidden)
        if want_hidden:
            hidden = out.decoder_hidden_states
            for r, (a, j) in enumerate(chunk):
                if context_hidden[a] is None:
                    context_hidden[a] = Pick(hidden, (r, 0))  # the decoder start position has read the context
                if j != COMPLETION and needs.candidate_hidden:
                    candidate_hidden[offsets[a] + j] = Pick(hidden, (r, len(inputs[r]) - 1))
    return batch_result(model, needs, sink, counts, context_hidden, candidate_hidden, device, touched)
