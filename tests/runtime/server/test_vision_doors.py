"""Images through every door against a live server on the tiny random Qwen2.5-VL checkpoint
(tests/vision_models.py): SGLang's /generate `image_data`, OpenAI chat `image_url` parts
(data: URL, local path, loopback http URL), Anthropic image blocks, Ollama `images`; the same
conversation gives the same prompt through every chat door; a repeated image is served from
the radix cache; limits and bad images are 4xx; a text-only model refuses images."""

from __future__ import annotations

import base64
import http.server
import threading
from collections.abc import Iterator

import anthropic
import httpx
import ollama
import openai
import pytest
from vision_models import IDS, png, vl_tokenizer

from conftest import Server

VISION = "<|vision_start|><|image_pad|><|vision_end|>"
RED, BLUE = png(64, 48, 11), png(64, 48, 12)  # 4 image tokens each
BIG = png(100, 80, 13)  # 12 tokens
GREEDY = {"max_new_tokens": 4, "temperature": 0}
IMAGE_PAD = IDS["<|image_pad|>"]


def data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


@pytest.fixture(scope="module")
def server(vision_server: Server) -> Server:
    (vision_server.root / "red.png").write_bytes(RED)
    return vision_server


@pytest.fixture(scope="module")
def loopback() -> Iterator[str]:
    """An http server on loopback serving RED at /red.png."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(RED)))
            self.end_headers()
            self.wfile.write(RED)

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/red.png"
    httpd.shutdown()


def generate(server: Server, **body) -> httpx.Response:
    return httpx.post(server.url + "/generate", json={"sampling_params": GREEDY, **body},
                      timeout=120)  # fmt: skip


def test_generate_image_data_and_the_radix_cache(server: Server) -> None:
    """/generate: one image (a data: URL), the same again (its tokens cached), another image
    of the same size (nothing cached from the image on), two images in one prompt, a batch."""
    server.endpoint.flush_cache()
    text = f"{VISION}Describe it."
    first = generate(server, text=text, image_data=data_url(RED)).json()
    again = generate(server, text=text + " Briefly.", image_data=[data_url(RED)]).json()
    other = generate(server, text=text + " Briefly.", image_data=base64.b64encode(BLUE).decode())
    two = generate(server, text=f"{VISION} vs {VISION}", image_data=[data_url(RED), data_url(BIG)])
    batch = generate(server, text=[text, text], image_data=[data_url(RED), [data_url(BLUE)]])
    plain = len(text) - len(VISION) + 3  # bytes, and the three vision tokens
    assert first["meta_info"]["prompt_tokens"] == plain - 1 + 4  # the placeholder: 4 tokens
    assert first["meta_info"]["cached_tokens"] == 0
    assert again["meta_info"]["cached_tokens"] >= plain - 1 + 4 - 1
    assert other.status_code == 200 and other.json()["meta_info"]["cached_tokens"] == 1
    assert two.status_code == 200 and two.json()["meta_info"]["prompt_tokens"] == 8 + 4 + 12
    assert batch.status_code == 200 and [len(b["output_ids"]) for b in batch.json()] == [4, 4]


def _chat(image_url: str, text: str = "What is this?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url}},
                                         {"type": "text", "text": text}]}]  # fmt: skip


def test_every_chat_door_renders_the_same_prompt(server: Server, loopback: str) -> None:
    """OpenAI (data: URL, local path, loopback URL), Anthropic (base64 block) and Ollama
    (base64 images) all reach the chat core with the same conversation: the same prompt
    length, and the image from the radix cache after the first."""
    server.endpoint.flush_cache()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    usages = []
    for url in (data_url(RED), str(server.root / "red.png"), loopback):
        reply = client.chat.completions.create(
            model="default", messages=_chat(url), max_tokens=4, temperature=0
        )
        assert reply.choices[0].message.content is not None
        usages.append(reply.usage)
    claude = anthropic.Anthropic(base_url=server.url, api_key="none").messages.create(
        model="default", max_tokens=4,
        messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(RED).decode()}},
            {"type": "text", "text": "What is this?"}]}],
    )  # fmt: skip
    llama = ollama.Client(host=server.url).chat(
        model="default", options={"temperature": 0, "num_predict": 4},
        messages=[{"role": "user", "content": "What is this?",
                   "images": [base64.b64encode(RED).decode()]}],
    )  # fmt: skip
    other = client.chat.completions.create(
        model="default", messages=_chat(data_url(BLUE)), max_tokens=4, temperature=0
    )
    template = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}
    ]
    rendered = vl_tokenizer().apply_chat_template(
        template, tokenize=False, add_generation_prompt=True
    )
    ids = vl_tokenizer().encode(rendered, add_special_tokens=False)
    prompt = len(ids) - 1 + 4  # the placeholder expanded to the image's 4 tokens
    assert [u.prompt_tokens for u in usages] == [prompt] * 3
    assert claude.usage.input_tokens + (claude.usage.cache_read_input_tokens or 0) == prompt
    assert llama.prompt_eval_count == prompt
    assert usages[0].prompt_tokens_details.cached_tokens == 0
    assert [u.prompt_tokens_details.cached_tokens for u in usages[1:]] == [prompt - 1] * 2
    assert other.usage.prompt_tokens_details.cached_tokens == ids.index(IMAGE_PAD)


BAD_GENERATE = [
    ({"image_data": "data:image/png;base64,AAAA"}, "decodable"),
    ({"image_data": "data:text/plain;base64,aGVsbG8="}, "not an image"),
    ({"image_data": 5}, "image_data"),
    ({"image_data": [data_url(RED), data_url(RED)]}, "placeholder"),
    ({"image_data": data_url(png(150, 150, 14))}, "exceeds"),  # past --max-image-bytes
    ({"text": VISION * 12, "image_data": [data_url(BIG)] * 12}, "too many images"),  # 170 > 160
    ({"image_data": "/no/such/file.png"}, "no image file"),
]


def test_bad_images_are_400s(server: Server) -> None:
    for change, phrase in BAD_GENERATE:
        answer = generate(server, **{"text": f"{VISION}Hi", **change})
        assert answer.status_code == 400 and phrase in answer.text, (change, answer.text)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    with pytest.raises(openai.BadRequestError, match="image_url"):
        client.chat.completions.create(
            model="default", max_tokens=4,
            messages=[{"role": "user", "content": [{"type": "image_url"}]}],
        )  # fmt: skip
    assert generate(server, text=f"{VISION}Hi", image_data=data_url(RED)).status_code == 200


def test_a_text_only_model_refuses_images(shared_server: Server) -> None:
    client = openai.OpenAI(base_url=shared_server.url + "/v1", api_key="none")
    with pytest.raises(openai.BadRequestError, match="vision"):
        client.chat.completions.create(model="default", messages=_chat(data_url(RED)))
    answer = generate(shared_server, text="Hi", image_data=data_url(RED))
    assert answer.status_code == 400 and "vision" in answer.text
