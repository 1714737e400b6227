"""Tinker's protobuf payloads, to and from plain Python: the ``forward_backward`` request, its output, and a sample
response. The schema is the SDK's own (``tinker.proto.tinker_public_pb2``); arrays travel as little-endian numpy
buffers.

Sizes are checked before anything is allocated: a datum's tokens, and the values a tensor announces (a sparse
tensor's shape, a dense tensor's buffer), must fit the model's positions (``most``, one value per token at most),
so that a small body cannot make this process densify a huge array.

This module converts; it neither checks what a loss needs (the Caller does) nor runs anything.
"""

from __future__ import annotations

import math

import numpy as np

_DTYPES = {1: np.float32, 2: np.int64, 3: np.int32}  # DTYPE_FLOAT32, DTYPE_INT64, DTYPE_INT32


def pb():
    """The SDK's generated protobuf module (an ImportError names the extra to install)."""
    try:
        from tinker.proto import tinker_public_pb2
    except ImportError as err:
        raise ImportError("the Tinker service needs the tinker SDK: pip install -e '.[tinker]' in llmrl's "
                          "clone") from err
    return tinker_public_pb2


def tensor_values(tensor, most: int, field: str = "tensor") -> list:
    """A ``Tensor`` message (dense, or sparse CSR) as a flat Python list of at most ``most`` values; ``field``
    names it in errors. The announced size is checked before any array is made."""
    dtype = _DTYPES.get(tensor.dtype)
    if dtype is None:
        raise ValueError(f"{field}: tensor dtype {tensor.dtype} is not supported (float32, int64, int32)")
    if tensor.WhichOneof("encoding") != "sparse_csr":
        size = np.dtype(dtype).itemsize
        _check_count(field, len(tensor.dense) // size, most, "values")
        if len(tensor.dense) % size:
            raise ValueError(f"{field}: a dense buffer of {len(tensor.dense)} bytes is not a whole number of "
                             f"{np.dtype(dtype).name} values")
        return np.frombuffer(tensor.dense, dtype=dtype).tolist()
    shape = [int(n) for n in tensor.shape]
    _check_count(field, math.prod(shape), most, f"values (shape {shape})")
    if len(shape) != 2 or min(shape) < 0:
        raise ValueError(f"{field}: a sparse CSR tensor has a shape of two sizes (rows, columns), got {shape}")
    csr = tensor.sparse_csr
    values = np.frombuffer(csr.values, dtype=dtype)
    crow = np.frombuffer(csr.crow_indices, dtype=np.int64)
    cols = np.frombuffer(csr.col_indices, dtype=np.int64)
    if (len(crow) != shape[0] + 1 or len(cols) != len(values) or crow[0] != 0 or crow[-1] != len(values)
            or np.any(np.diff(crow) < 0) or np.any((cols < 0) | (cols >= shape[1]))):
        raise ValueError(f"{field}: its sparse CSR indices do not describe a {shape} tensor ({shape[0] + 1} row "
                         f"pointers from 0 to the {len(values)} values, columns below {shape[1]}): send it dense")
    dense = np.zeros(tuple(shape), dtype=dtype)
    for row in range(shape[0]):
        dense[row, cols[crow[row]:crow[row + 1]]] = values[crow[row]:crow[row + 1]]
    return dense.reshape(-1).tolist()


def _check_count(field: str, count: int, most: int, what: str) -> None:
    if count > most:
        raise ValueError(f"{field} holds {count} {what}, more than the {most} positions this model takes (at most "
                         "one value per token): send at most that many")


def chunk_tokens(chunks, most: int | None = None, field: str = "model_input") -> list[int]:
    """The token ids of a model input's chunks (text only: images and audio are refused), at most ``most``."""
    arrays = []
    for chunk in chunks:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise ValueError(f"model input chunks of type {kind!r} are not supported: llmrl serves text models")
        arrays.append(chunk.encoded_text.tokens)
    if most is not None:
        _check_count(field, sum(len(a) for a in arrays) // 4, most, "tokens")
    return [t for a in arrays for t in np.frombuffer(a, dtype=np.int32).tolist()]


def parse_forward_backward(body: bytes, most: int) -> dict:
    """A ``ForwardBackwardRequest`` as ``{model_id, seq_id, loss_fn, loss_fn_config, forward_only, data}``, each
    datum in llmrl's form (``model_input`` ids, ``loss_fn_inputs`` of lists); ``most``: the model's positions, the
    bound of a datum's tokens and of each of its tensors' values (a ValueError naming the field beyond it)."""
    request = pb().ForwardBackwardRequest()
    request.ParseFromString(body)
    config = {key: (value.number if value.WhichOneof("value") == "number" else value.text)
              for key, value in request.loss_fn_config_v2.items()} or dict(request.loss_fn_config)
    data = []
    for n, datum in enumerate(request.data):
        tokens = chunk_tokens(datum.model_input, most, f"data[{n}].model_input")
        inputs = {key: tensor_values(tensor, most, f"data[{n}].loss_fn_inputs[{key!r}]")
                  for key, tensor in datum.loss_fn_inputs.items()}
        if "target_tokens" in inputs:
            inputs["target_tokens"] = [int(t) for t in inputs["target_tokens"]]
        data.append({"model_input": tokens, "loss_fn_inputs": inputs})
    return {"model_id": request.model_id, "seq_id": request.seq_id, "loss_fn": request.loss_fn,
            "loss_fn_config": config, "forward_only": request.forward_only, "data": data}


def forward_backward_output(outputs: list[dict], metrics: dict[str, float]) -> bytes:
    """A ``ForwardBackwardOutput``: per datum its float32 per-token outputs (``logprobs``, ``elementwise_loss``), and
    the metrics (keys ``name:reduction``)."""
    proto = pb()
    out = proto.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    record = out.loss_fn_outputs.add()
    record.num_datums = len(outputs)
    for field in (outputs[0].keys() if outputs else ()):
        arrays = [np.asarray(o[field], dtype=np.float32).reshape(-1) for o in outputs]
        batched = record.fields[field]
        batched.dtype = proto.DTYPE_FLOAT32
        batched.data = b"".join(a.tobytes() for a in arrays)
        batched.offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64).tobytes()
    for key, value in metrics.items():
        out.metrics[key] = float(value)
    return out.SerializeToString()


def sample_response(samples: list[dict], prompt_logprobs: list[float] | None) -> bytes:
    """A ``SampleResponse`` from llmrl's samples (``tokens``, ``logprobs`` per token, ``stop_reason``), with the
    prompt's log-probs (NaN at the first position) when asked for."""
    proto = pb()
    response = proto.SampleResponse()
    for sample in samples:
        sequence = response.sequences.add()
        sequence.stop_reason = proto.STOP_REASON_LENGTH if sample["stop_reason"] == "length" else \
            proto.STOP_REASON_STOP
        sequence.tokens = np.asarray(sample["tokens"], dtype=np.int32).tobytes()
        sequence.logprobs = np.asarray(sample["logprobs"], dtype=np.float32).tobytes()
    if prompt_logprobs is not None:
        response.prompt_logprobs = np.asarray([math.nan, *prompt_logprobs], dtype=np.float32).tobytes()
    return response.SerializeToString()
