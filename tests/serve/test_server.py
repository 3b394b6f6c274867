"""`juno-py serve` through the official `openai` client, against a server this module starts on a loopback port:
replies equal what the model generates directly with the same adapters and seed (streamed and not), adapters
selected by name and combined, OpenAI-shaped errors, and 50 concurrent requests all answered with their own
replies."""

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
import uvicorn

from juno_py.cli.serve_cmd import bind
from juno_py.lora import Mode, load_adapters
from juno_py.models import load_model
from juno_py.models.generate import generate
from juno_py.playback import Adapters, open_model
from juno_py.server import Engine, build_app
from juno_py.testing.tiny_models import write_tiny_gguf
from tests.merge.helpers import make_adapter

# qwen2's tiny model has an untied output, so its replies vary with the prompt (a tied one repeats its last token)
ARCH = "qwen2"
# the file's own template, unlike the architecture's built-in one, and refusing a conversation that opens with a tool
TEMPLATE = (
    "{% if messages[0]['role'] == 'tool' %}{{ raise_exception('a conversation cannot open with a tool') }}{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}<|im_start|>assistant:"
)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve")
    base = write_tiny_gguf(folder / "tiny.gguf", ARCH, seed=3, metadata={"tokenizer.chat_template": TEMPLATE})
    return {
        "base": base,
        "a": make_adapter(base, folder / "a.bin", rank=4, b_std=0.2, seed=1),
        "b": make_adapter(base, folder / "b.bin", targets="mlp", rank=2, b_std=0.2, seed=2),
        "d": make_adapter(base, folder / "d.bin", targets="qv", rank=2, mode=Mode.DORA, b_std=0.2, seed=4),
    }


@pytest.fixture(scope="module")
def server(files):
    """The app on 127.0.0.1:<free port>, in a thread of this process; yields its base URL."""
    model = open_model(files["base"], weights_cache="none", compute_dtype="fp32")
    adapters = Adapters(model, {k: v for k, v in files.items() if k != "base"})
    engine = Engine(model, adapters, max_queue=64)
    sock = bind("127.0.0.1", 0)
    srv = uvicorn.Server(uvicorn.Config(build_app(engine), log_level="warning", lifespan="on"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60  # a hang guard, not a timing assertion
    while not srv.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert srv.started, "the server did not start"
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    srv.should_exit = True
    thread.join(30)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(api_key="unused", base_url=f"{server}/v1", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(files):
    """reference(adapters, messages=..., prompt=..., max_tokens, seed): the text generate() gives directly on a
    model loaded apart from the server's, decoded the way a stream is (whole characters, pieces joined)."""
    models = {}

    def reply(adapters=(), messages=None, prompt=None, max_tokens=12, seed=5, temperature=1.0):
        key = tuple(adapters)
        if key not in models:
            models[key] = load_model(files["base"])
            if adapters:
                load_adapters(models[key], [(str(files[n]), s) for n, s in adapters])
        model = models[key]
        tok = model.tokenizer
        ids = tok.apply_chat_template(messages) if messages is not None else tok.encode(prompt)
        out = generate(model, ids, max_tokens, temperature=temperature, top_p=1.0, seed=seed, stop_ids=tok.eog_ids)
        decoder = tok.stream()
        return "".join(decoder.push(t) for t in out) + decoder.flush(), len(ids), len(out)

    return reply


def ask(client, model, text, stream=False, **kw):
    kw = {"max_tokens": 12, "seed": 5, "temperature": 1.0, "top_p": 1.0, **kw}
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": text}], stream=stream, **kw
    )


def test_models_lists_base_and_adapters(client):
    assert [m.id for m in client.models.list().data] == ["base", "a", "b", "d"]
    assert client.models.retrieve("a").id == "a"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


@pytest.mark.parametrize(
    "model, adapters",
    [
        ("base", ()),
        ("a", (("a", 1.0),)),
        ("b", (("b", 1.0),)),
        ("d", (("d", 1.0),)),
        ("a+b:0.5", (("a", 1.0), ("b", 0.5))),
    ],  # fmt: skip
)
def test_chat_reply_is_the_models_with_the_selected_adapters(client, reference, files, model, adapters):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi there"}]
    r = client.chat.completions.create(
        model=model, messages=messages, max_tokens=12, seed=5, temperature=1.0, top_p=1.0
    )
    text, n_prompt, n_out = reference(adapters, messages=messages)
    assert r.model == model and r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == text
    assert r.choices[0].finish_reason == ("length" if n_out == 12 else "stop")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, n_out)
    assert r.usage.total_tokens == n_prompt + n_out
    # the prompt is the file's template, rendered here by hand
    tok = load_model(files["base"]).tokenizer
    by_hand = "<|im_start|>system: Be brief.\n<|im_start|>user: hi there\n<|im_start|>assistant:"
    assert n_prompt == len(tok.encode(by_hand, add_special=False, parse_special=True))


def test_adapters_change_the_reply(client):
    replies = {m: ask(client, m, "what is the capital").choices[0].message.content for m in ("base", "a", "b", "a+b")}
    assert len(set(replies.values())) == 4, replies


def test_streamed_chat_is_the_same_reply(client):
    whole = ask(client, "a", "hi there").choices[0].message.content
    chunks = list(ask(client, "a", "hi there", stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(pieces) == whole and len([p for p in pieces if p]) > 1  # more than one piece: it streamed
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[:-1] == [None] * (len(finishes) - 1) and finishes[-1] in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert len({c.id for c in chunks}) == 1


def test_completions_plain_and_streamed(client, reference):
    text, n_prompt, n_out = reference((("b", 1.0),), prompt="The capital of France is", max_tokens=10, seed=9)
    kw = dict(model="b", prompt="The capital of France is", max_tokens=10, seed=9, temperature=1.0, top_p=1.0)
    r = client.completions.create(**kw)
    assert r.object == "text_completion" and r.choices[0].text == text
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, n_out)
    streamed = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in streamed) == text
    assert streamed[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_greedy_and_length(client, reference):
    text, _, n_out = reference((), messages=[{"role": "user", "content": "x"}], max_tokens=3, temperature=0)
    r = ask(client, "base", "x", max_tokens=3, temperature=0, seed=None)
    assert r.choices[0].message.content == text and n_out == 3
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


def test_stop_text_ends_the_reply_before_it(client):
    full = ask(client, "base", "what is the capital", max_tokens=24).choices[0].message.content
    plain = [i for i in range(3, len(full) - 2) if full[i : i + 2].isprintable() and "\ufffd" not in full[i : i + 2]]
    assert plain, f"no printable pair to stop at in {full!r}"
    stop = full[plain[0] : plain[0] + 2]
    for stream in (False, True):
        r = ask(client, "base", "what is the capital", max_tokens=24, stop=[stop, "never appears"], stream=stream)
        if stream:
            chunks = list(r)
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        assert text == full[: full.index(stop)] and finish == "stop"


def post(server, path, data, method="POST"):
    req = urllib.request.Request(f"{server}{path}", data=data, method=method)
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_bad_requests_get_openai_errors(client, server):
    with pytest.raises(openai.NotFoundError) as e:
        ask(client, "nope", "hi")
    assert e.value.status_code == 404 and e.value.code == "model_not_found" and "served: base, a, b, d" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        ask(client, "a+nope:0.5", "hi")
    cases = [
        (dict(temperature=5), "temperature"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(n=2), "n"),
        (dict(stop=["a", "b", "c", "d", "e"]), "stop"),
    ]
    for kw, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            ask(client, "base", "hi", **kw)
        assert e.value.status_code == 400 and e.value.param == param, (kw, e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="base", messages=[])
    assert e.value.param == "messages"
    with pytest.raises(openai.BadRequestError) as e:  # DoRA plays alone: found when the worker installs it
        ask(client, "d+a", "hi")
    assert "DoRA" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:  # the tiny model's context is 128 tokens
        client.completions.create(model="base", prompt=" the" * 300, max_tokens=4)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, "d+a", "hi", stream=True)  # a streamed request fails the same way, before any event
    with pytest.raises(openai.BadRequestError, match="a conversation cannot open with a tool"):
        client.chat.completions.create(model="base", messages=[{"role": "tool", "content": "x", "tool_call_id": "1"}])
    status, body = post(server, "/v1/chat/completions", b'{"model": "base", "messages": [')
    assert status == 400 and body["error"]["type"] == "invalid_request_error" and "JSON" in body["error"]["message"]
    for value in (b"Infinity", b"NaN"):  # the client refuses to send them; Python's JSON reads them
        status, body = post(server, "/v1/chat/completions", b'{"model": "base", "messages": [{"role": "user", "content": "x"}], "top_p": %s}' % value)  # fmt: skip
        assert status == 400 and body["error"]["param"] == "top_p", body
    status, body = post(server, "/v1/chat/completions", b"[1, 2]")
    assert status == 400 and "object" in body["error"]["message"]
    status, body = post(server, "/v1/nowhere", b"{}")
    assert status == 404 and set(body["error"]) == {"message", "type", "param", "code"}
    status, body = post(server, "/v1/chat/completions", None, method="GET")
    assert status == 405 and "GET" in body["error"]["message"]
    # after all of that the server still answers
    assert ask(client, "a", "hi").choices[0].finish_reason in ("stop", "length")


def test_fifty_concurrent_requests_all_get_their_own_reply(server, reference):
    """50 requests at once over 3 selections: every one answered (none lost, none refused), each with the reply
    its own prompt, seed and adapters give when generated alone."""
    models = ["base", "a", "a+b:0.5"]
    selections = {"base": (), "a": (("a", 1.0),), "a+b:0.5": (("a", 1.0), ("b", 0.5))}
    jobs = [(models[i % 3], f"question {i}", i) for i in range(50)]

    async def run():
        async with openai.AsyncOpenAI(api_key="unused", base_url=f"{server}/v1", max_retries=0, timeout=300) as c:

            async def one(model, text, seed):
                r = await c.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": text}], max_tokens=4, seed=seed, top_p=1.0
                )
                return r.choices[0].message.content

            return await asyncio.gather(*(one(*job) for job in jobs))

    replies = asyncio.run(run())
    assert len(replies) == 50
    for (model, text, seed), got in zip(jobs, replies):
        want, _, _ = reference(selections[model], messages=[{"role": "user", "content": text}], max_tokens=4, seed=seed)
        assert got == want, (model, text, seed)
    status, body = post(server, "/health", None, method="GET")
    assert status == 200 and body["served"] >= 50


def test_the_command_serves_and_stops_on_ctrl_c(files, tmp_path):
    cmd = [sys.executable, "-m", "juno_py", "serve", "--model-path", str(files["base"]), "--adapter", f"mine={files['a']}", "--port", "0", "--weights-cache", "none"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stderr.readline()
        m = re.search(r"juno-py serve: (http://127\.0\.0\.1:\d+/v1) \(models: base, mine\); compute \w+, weights", line)
        assert m, line + proc.stderr.read() if proc.poll() is not None else line
        client = openai.OpenAI(api_key="unused", base_url=m[1], max_retries=0, timeout=60)
        assert [x.id for x in client.models.list().data] == ["base", "mine"]
        assert ask(client, "mine", "hi", max_tokens=2).usage.completion_tokens >= 1
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err


def test_a_bad_adapter_fails_at_start_in_one_line(files, tmp_path):
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"not an adapter")
    r = subprocess.run(
        [sys.executable, "-m", "juno_py", "serve", "--model-path", str(files["base"]), "--adapter", str(bad)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
        timeout=120,
    )
    assert r.returncode == 1 and str(bad) in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "juno_py", "serve", "--model-path", str(files["base"]), "--adapter", "base=x.bin"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
        timeout=120,
    )
    assert r.returncode == 1 and "cannot be used" in r.stderr, r.stderr
