"""`radixflow serve --chat-template`: the server's own chat rendering (OpenAI chat completions)
uses the given template, as the scheduler's model_info does."""

from __future__ import annotations

import httpx

from conftest import Server

TEMPLATE = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}[assistant]"


def test_chat_completions_render_with_the_served_template() -> None:
    runtime = Server(chat_template=TEMPLATE, max_total_tokens=2048)
    try:
        assert runtime.endpoint.model_info()["chat_template"] == TEMPLATE
        body = {
            "model": "smollm2",
            "messages": [{"role": "user", "content": "Hi there"}],
            "max_tokens": 1,
            "temperature": 0,
        }
        reply = httpx.post(f"{runtime.url}/v1/chat/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        want = runtime.get_tokenizer().encode("[user]Hi there[assistant]", add_special_tokens=False)
        assert reply.json()["usage"]["prompt_tokens"] == len(want)
    finally:
        runtime.shutdown()
