"""SGLang's image programs through the DSL (`sgl.image`, `sgl.video`) against the tiny random
Qwen2.5-VL checkpoint, over ZeroMQ (image bytes in the frame) and HTTP (/generate's
image_data): the structure of what comes back, never its quality (the weights are random)."""

from __future__ import annotations

import io

import pytest
from vision_models import png, vl_tokenizer

import radixflow as sgl
from conftest import Server

QUESTION = "Please describe this image in simple words."


@pytest.fixture(params=["zmq", "http"])
def backend(vision_server: Server, request: pytest.FixtureRequest) -> sgl.RuntimeEndpoint:
    address = vision_server.address if request.param == "zmq" else vision_server.url
    endpoint = sgl.RuntimeEndpoint(address)
    yield endpoint
    endpoint.shutdown() if hasattr(endpoint, "shutdown") else None


def expected_prompt_tokens(text: str, image_tokens: list[int]) -> int:
    """Tokens of the program's text with each placeholder expanded to its image's tokens."""
    return (
        len(vl_tokenizer().encode(text, add_special_tokens=False))
        - len(image_tokens)
        + sum(image_tokens)
    )


@sgl.function
def image_qa(s, image, question):  # SGLang's test_programs.test_image_qa, the image a parameter
    s += sgl.user(sgl.image(image) + question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=6))


def test_image_qa(backend: sgl.RuntimeEndpoint, vision_server: Server) -> None:
    """The image from a path; the answer closes the assistant turn; the prompt counted the
    image's 4 tokens; asked again, the prompt (image included) comes from the radix cache."""
    path = vision_server.root / "qa.png"
    path.write_bytes(png(64, 48, 21))
    assert backend.flush_cache()  # nothing runs: the cache starts empty
    state = image_qa.run(image=str(path), question=QUESTION, temperature=0, backend=backend)
    again = image_qa.run(image=str(path), question=QUESTION, temperature=0, backend=backend)
    roles = [m["role"] for m in state.messages()]
    assert (
        roles[-2:] == ["user", "assistant"] and state.messages()[-1]["content"] == state["answer"]
    )
    assert "<|image_pad|>" in state.messages()[-2]["content"] and QUESTION in state.text()
    meta = state.get_meta_info("answer")
    assert meta["prompt_tokens"] == expected_prompt_tokens(_prompt_of(state, "answer"), [4])
    assert again["answer"] == state["answer"]
    second = again.get_meta_info("answer")
    why = {"first": meta, "second": second, "server": backend.stats()}  # should this ever fail
    assert second["cached_tokens"] == meta["prompt_tokens"] - 1, why


@sgl.function
def compare(s, first, second):
    s += sgl.user(sgl.image(first) + sgl.image(second) + "Are these the same?")
    s += sgl.assistant(sgl.gen("answer", max_tokens=4))
    s += sgl.user("Why?")
    s += sgl.assistant(sgl.gen("why", max_tokens=4))


def test_two_images_and_a_second_turn(backend: sgl.RuntimeEndpoint) -> None:
    """Bytes and a PIL image in one turn (4 + 12 tokens); the second turn carries them on."""
    from PIL import Image

    second = Image.open(io.BytesIO(png(100, 80, 22)))
    state = compare.run(first=png(64, 48, 23), second=second, temperature=0, backend=backend)
    first_meta, why_meta = state.get_meta_info("answer"), state.get_meta_info("why")
    assert first_meta["prompt_tokens"] == expected_prompt_tokens(
        _prompt_of(state, "answer"), [4, 12]
    )
    assert why_meta["prompt_tokens"] == expected_prompt_tokens(_prompt_of(state, "why"), [4, 12])
    assert why_meta["cached_tokens"] >= first_meta["prompt_tokens"]  # the images' KV reused


def test_video_frames_and_batches(backend: sgl.RuntimeEndpoint, vision_server: Server) -> None:
    """A video's frames sampled with PyAV, each an image; image programs in run_batch."""
    av = pytest.importorskip("av")
    path = vision_server.root / "clip.mp4"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=4)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for i in range(6):
            from PIL import Image

            frame = av.VideoFrame.from_image(Image.open(io.BytesIO(png(64, 48, 30 + i))))
            container.mux(stream.encode(frame))
        container.mux(stream.encode())

    @sgl.function
    def video_qa(s):
        s += sgl.user(sgl.video(str(path), 3) + "What happens?")
        s += sgl.assistant(sgl.gen("answer", max_tokens=4))

    state = video_qa.run(temperature=0, backend=backend)
    assert state.messages()[-2]["content"].count("<|image_pad|>") == 3
    assert state.get_meta_info("answer")["prompt_tokens"] == expected_prompt_tokens(
        _prompt_of(state, "answer"), [4, 4, 4]
    )
    states = image_qa.run_batch(
        [{"image": png(64, 48, 40 + i), "question": QUESTION} for i in range(2)],
        temperature=0, backend=backend,
    )  # fmt: skip
    for one in states:
        meta = one.get_meta_info("answer")
        assert meta["prompt_tokens"] == expected_prompt_tokens(_prompt_of(one, "answer"), [4])
        assert meta["completion_tokens"] > 0 and one.messages()[-1]["content"] == one["answer"]


def _prompt_of(state: sgl.ProgramState, name: str) -> str:
    """The text before the gen `name` (the prompt its request carried)."""
    text, answer = state.text(), state[name]
    end = text.rindex(answer) if answer else len(text) - len("<|im_end|>\n")
    return text[:end]
