"""The OpenAI-compatible endpoint over HTTP, in process, on a scripted stand-in for ``Caller.generate``
(:mod:`testkit.openai_fake`): a request without the key is a 401; every field the endpoint does not honour, and every
unknown or malformed field, is a 400 whose ``param`` names it, and the server answers the next request; a no-op
value is accepted. The prompt the endpoint generates from is the tokenizer's own chat template rendering (tools
included), the answer carries the sampled text, tool calls and log-probs, and a template that ignores tools is
refused. The stream carries the same answer. ``llmrl openai`` hands its options to the endpoint and refuses a key on
its command line."""

from __future__ import annotations

import http.client
import json

import pytest

from llmrl import openai_endpoint
from testkit.openai_fake import CHATML, TOOLS, ScriptedCaller, chat_tokenizer, post, rendered

KEY = "llmrl-test-key"
HELLO = [{"role": "system", "content": "You play."}, {"role": "user", "content": "Go north?"}]
WEATHER = [{"type": "function", "function": {"name": "weather", "description": "The weather in a city.",
                                             "parameters": {"type": "object", "properties": {"city": {
                                                 "type": "string"}}}}}]


@pytest.fixture(scope="module")
def tokenizer(tiny):
    return chat_tokenizer(tiny["gpt2"])


@pytest.fixture
def caller(tokenizer):
    return ScriptedCaller(tokenizer)


@pytest.fixture
def endpoint(caller):
    with openai_endpoint(caller, api_key=KEY) as running:
        yield running


def chat(endpoint, **fields):
    return post(endpoint.base_url, "/v1/chat/completions", {"model": "main", "messages": HELLO, **fields}, KEY)


def test_a_request_without_the_key_is_refused_and_the_server_goes_on(endpoint, caller):
    host, port = endpoint.url.split("//")[1].split(":")
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        connection = http.client.HTTPConnection(host, int(port), timeout=10)
        connection.request("GET", "/v1/models", headers=headers)
        response = connection.getresponse()
        answer = json.loads(response.read())
        assert response.status == 401 and answer["error"]["code"] == "invalid_api_key"
        connection.close()
    caller.replies.append("North.")
    assert chat(endpoint)[0] == 200
    assert caller.calls and len(caller.calls) == 1  # only the keyed request reached generate


REFUSED = [
    ({"presence_penalty": 0.5}, "presence_penalty"), ({"frequency_penalty": 1}, "frequency_penalty"),
    ({"logit_bias": {"5": 10}}, "logit_bias"), ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"top_logprobs": 3}, "top_logprobs"), ({"best_of": 2}, "best_of"), ({"reasoning_effort": "high"},
                                                                          "reasoning_effort"),
    ({"colour": "blue"}, "colour"), ({"temperature": 3}, "temperature"), ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"n": 0}, "n"), ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": 2.5}, "max_completion_tokens"), ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"seed": "x"}, "seed"), ({"logprobs": 3}, "logprobs"), ({"stream": "yes"}, "stream"), ({"user": 7}, "user"),
    ({"model": "other"}, "model"), ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"tool_choice": "required", "tools": WEATHER}, "tool_choice"), ({"tools": [{"type": "code"}]}, "tools[0]"),
]


@pytest.mark.parametrize("fields, param", REFUSED, ids=[p for _, p in REFUSED])
def test_each_unhonoured_or_malformed_field_is_a_400_naming_it_and_the_server_goes_on(endpoint, caller, fields,
                                                                                       param):
    status, answer = chat(endpoint, **fields)
    assert status == (404 if param == "model" else 400), answer
    assert answer["error"]["param"] == param and param.split("[")[0] in answer["error"]["message"]
    assert caller.calls == []  # refused before generate
    caller.replies.append("North.")
    assert chat(endpoint)[0] == 200


def test_a_no_op_value_of_an_unhonoured_field_is_accepted(endpoint, caller):
    caller.replies.append("North.")
    status, answer = chat(endpoint, presence_penalty=0, frequency_penalty=0.0, logit_bias={}, top_logprobs=0,
                          response_format={"type": "text"}, parallel_tool_calls=True, stream=False)
    assert status == 200, answer


@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", b"\xff\xfe"])
def test_a_body_that_is_not_a_json_object_is_a_400_and_the_server_goes_on(endpoint, caller, body):
    status, answer = post(endpoint.base_url, "/v1/chat/completions", body, KEY)
    assert status == 400 and "JSON" in answer["error"]["message"]
    caller.replies.append("North.")
    assert chat(endpoint)[0] == 200


def test_the_prompt_is_the_templates_rendering_and_the_answer_the_sample(endpoint, caller):
    tokenizer = caller.tokenizer
    caller.replies.append("I go north.")
    status, answer = chat(endpoint, temperature=0.7, top_p=0.9, max_tokens=12, seed=5, logprobs=True, stop=["!"])
    assert status == 200, answer
    (contexts, kwargs), = caller.calls
    assert contexts == [rendered(tokenizer, HELLO)]
    assert kwargs == {"llm": "main", "seed": 5, "max_new_tokens": 12, "do_sample": True, "num_return_sequences": 1,
                      "temperature": 0.7, "top_p": 0.9, "top_k": 0, "stop": ["!"]}
    (choice,) = answer["choices"]
    ids = caller.ids("I go north.")
    assert choice["message"] == {"role": "assistant", "content": "I go north."} and choice["finish_reason"] == "stop"
    assert [t["logprob"] for t in choice["logprobs"]["content"]] == [-0.5 - k / 10 for k in range(len(ids))]
    assert "".join(t["token"] for t in choice["logprobs"]["content"]) == tokenizer.decode(ids)
    assert answer["usage"] == {"prompt_tokens": len(contexts[0]), "completion_tokens": len(ids),
                               "total_tokens": len(contexts[0]) + len(ids)}


def test_greedy_decoding_runs_once_for_n_choices(endpoint, caller):
    caller.replies.append("North.")
    status, answer = chat(endpoint, temperature=0, n=3)
    assert status == 200 and caller.calls[0][1]["num_return_sequences"] == 1
    assert [c["message"]["content"] for c in answer["choices"]] == ["North."] * 3


def test_a_completion_prompt_is_tokenised_once_or_used_as_ids(endpoint, caller):
    tokenizer = caller.tokenizer
    caller.replies.extend([[5, 6, 7], [8, 9]])
    status, answer = post(endpoint.base_url, "/v1/completions", {"model": "main", "prompt": "Once upon",
                                                                  "max_tokens": 3, "logprobs": 0}, KEY)
    assert status == 200 and caller.calls[0][0] == [tokenizer.encode("Once upon")]
    assert answer["choices"][0]["text"] == tokenizer.decode([5, 6, 7])
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["choices"][0]["logprobs"]["token_logprobs"] == [-0.5, -0.6, -0.7]
    status, answer = post(endpoint.base_url, "/v1/completions", {"model": "main", "prompt": [3, 4, 5]}, KEY)
    assert status == 200 and caller.calls[1][0] == [[3, 4, 5]]
    status, answer = post(endpoint.base_url, "/v1/completions", {"model": "main", "prompt": ["a", "b"]}, KEY)
    assert status == 400 and answer["error"]["param"] == "prompt"


def test_tools_are_rendered_by_the_template_and_calls_parsed(tiny):
    caller = ScriptedCaller(chat_tokenizer(tiny["gpt2"], TOOLS))
    caller.replies.append('<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>')
    with openai_endpoint(caller, api_key=KEY) as endpoint:
        status, answer = chat(endpoint, tools=WEATHER, tool_choice="auto")
    assert status == 200, answer
    assert caller.calls[0][0] == [rendered(caller.tokenizer, HELLO, WEATHER)] != [rendered(caller.tokenizer, HELLO)]
    (choice,) = answer["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def test_a_template_that_ignores_tools_is_refused(endpoint, caller):
    assert caller.tokenizer.chat_template == CHATML  # no `tools` in it
    status, answer = chat(endpoint, tools=WEATHER)
    assert status == 400 and answer["error"]["param"] == "tools" and "ignores tools" in answer["error"]["message"]
    assert caller.calls == []


def test_a_stream_carries_the_same_answer(endpoint, caller):
    caller.replies.extend(["North.", "North."])
    _, whole = chat(endpoint, seed=1)
    status, raw = chat(endpoint, seed=1, stream=True)
    events = [line[len("data: "):] for line in raw.split("\n\n") if line]
    assert status == 200 and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == \
        whole["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_models_lists_the_served_llms(endpoint):
    host, port = endpoint.url.split("//")[1].split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    connection.request("GET", "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    answer = json.loads(connection.getresponse().read())
    assert [m["id"] for m in answer["data"]] == ["main"]


def test_llmrl_openai_hands_its_options_to_the_endpoint_and_refuses_a_key_on_the_command_line():
    from llmrl.launch.openai import MODULE, parse_argv

    request = parse_argv(["--config", "c.yaml", "--port", "0", "llms.main.replicas=2", "--llm=main"])
    assert request.options.module == MODULE and request.options.script_args == ["--port", "0", "--llm=main"]
    assert request.options.overrides == ["llms.main.replicas=2"]
    with pytest.raises(SystemExit, match="api-key-file"):
        parse_argv(["--config", "c.yaml", "--api-key", "k"])


def test_llmrl_openais_key_comes_from_its_file_else_the_environment_else_is_drawn(tmp_path):
    from llmrl.engine.openai_api.serve import KEY_ENV, endpoint_key, parse_args

    (tmp_path / "key").write_text("from-file\nignored\n")
    assert endpoint_key(parse_args(["--api-key-file", str(tmp_path / "key")]), {KEY_ENV: "env"})[0] == "from-file"
    assert endpoint_key(parse_args([]), {KEY_ENV: "from-env"}) == ("from-env", f"${KEY_ENV}")
    drawn, source = endpoint_key(parse_args([]), {})
    assert source == "drawn" and len(drawn) > 20 and drawn != endpoint_key(parse_args([]), {})[0]
    (tmp_path / "empty").write_text("\n")
    for name in ("empty", "missing"):
        with pytest.raises(ValueError, match=name):
            endpoint_key(parse_args(["--api-key-file", str(tmp_path / name)]), {})


def test_connections_beyond_the_cap_are_answered_503_and_a_freed_slot_serves_again():
    """The endpoint serves at most ``max_connections`` connections at once (the Tinker service's cap, one shared
    server class): silent connections beyond it get a 503 in OpenAI's error shape at once, not a thread each; once
    the held ones end, their slots serve again."""
    import socket
    import threading

    from llmrl.engine.openai_api.http import make_server

    server = make_server(object(), "127.0.0.1", 0, "k", idle_timeout=30.0, max_connections=2)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    try:
        existing = set(threading.enumerate())
        held = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(6)]  # silent
        answers = []
        for sock in held[2:]:  # the first 2 are accepted in order and held
            chunks = []
            while chunk := sock.recv(65536):
                chunks.append(chunk)
            answers.append(b"".join(chunks))
        assert all(a.startswith(b"HTTP/1.1 503") for a in answers), answers[0]
        assert json.loads(answers[0].split(b"\r\n\r\n", 1)[1])["error"]["code"] == 503
        handlers = [t for t in threading.enumerate() if t not in existing]
        assert len(handlers) == 2  # a thread for each held connection, none for the refused ones
        for sock in held:
            sock.close()
        for thread in handlers:  # each ends (and frees its slot) once it reads its connection's end
            thread.join()
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        connection.request("GET", "/v1/models", headers={"Authorization": "Bearer wrong"})
        assert connection.getresponse().status == 401  # served again: the key is checked
        connection.close()
    finally:
        server.shutdown()
        server.server_close()
