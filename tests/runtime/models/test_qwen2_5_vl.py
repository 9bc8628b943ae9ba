"""Qwen2.5-VL against transformers in fp32 on a tiny random checkpoint: logits of a ragged
step holding a one-image and a two-image prompt (each row against transformers alone), greedy
decoding after the images (mrope's position delta) through the engine, alone and batched,
with the cache on and off; and image tokens in the radix tree (keyed by the pixels)."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from family_models import one_thread
from vision_models import IDS, image_processor, png, save_qwen2_5_vl, vl_tokenizer

from radixflow.runtime import Engine
from radixflow.runtime.config import ServerConfig
from radixflow.runtime.model_executor.model_runner import ModelRunner, load_model
from radixflow.runtime.protocol.sampling import SamplingParams
from radixflow.runtime.scheduler.batch import build_plan
from radixflow.runtime.scheduler.request import Req
from radixflow.runtime.server.images import ImageRules

TOLERANCE = 1e-4
PAD = IDS["<|image_pad|>"]
IMAGES = {"a": png(64, 48, 1), "b": png(100, 80, 2), "c": png(64, 48, 3), "d": png(64, 48, 4)}
# tokens: a, c and d 4 each (2 x 2 merged cells), b 12 (4 x 3)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    with one_thread():
        yield save_qwen2_5_vl(tmp_path_factory.mktemp("vl"))


@pytest.fixture(scope="module")
def engine(checkpoint):
    """Page 1, 8-token prefill chunks (they cut through images), self-checks on."""
    made = Engine(
        model=str(checkpoint[0]), device="cpu", dtype="float32", max_total_tokens=1024,
        chunked_prefill_size=8, self_check=True,
    )  # fmt: skip
    yield made
    made.shutdown()


def _prompt(text: str) -> list[int]:
    """`text` with each `@` an image: <|vision_start|><|image_pad|><|vision_end|>."""
    tokenizer = vl_tokenizer()
    vision = "<|vision_start|><|image_pad|><|vision_end|>"
    return tokenizer.encode(text.replace("@", vision), add_special_tokens=False)


def _hf_logits(hf_model, ids: list[int], images: list[bytes]) -> torch.Tensor:
    """transformers' logits (L, vocab) of `ids` (image placeholders already expanded)."""
    from PIL import Image

    kwargs = {}
    if images:
        pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
        processed = image_processor()(images=pil, return_tensors="pt")
        kwargs = dict(pixel_values=processed["pixel_values"],
                      image_grid_thw=processed["image_grid_thw"])  # fmt: skip
    ids_t = torch.tensor([ids])
    with torch.no_grad():
        out = hf_model(input_ids=ids_t, mm_token_type_ids=(ids_t == PAD).int(), **kwargs)
    return out.logits[0]


def _rules(vision: dict) -> ImageRules:
    return ImageRules(vision, 1 << 20, 1 << 22, 1 << 20, allow_local=False)


def test_ragged_logits_match_transformers(checkpoint):
    """One step: a prompt with one image and one with two (a cut image's tail in the second
    half), each row's logits against transformers on that prompt alone."""
    path, hf_model = checkpoint
    with one_thread():
        model = load_model(path, ServerConfig(), torch.device("cpu"), torch.float32)
        runner = ModelRunner(model, 256)
        rules = _rules(model.vision.info)
        prompts = [(_prompt("look @ at this"), ["a"]), (_prompt("@ and @: same?"), ["b", "c"])]
        reqs, expanded, next_slot = [], [], 1
        for n, (ids, names) in enumerate(prompts):
            shown, keyed, items = rules.items([IMAGES[x] for x in names], ids, 272)
            req = Req(f"r{n}", keyed, SamplingParams(max_new_tokens=1), images=items)
            req.slots = np.arange(next_slot, next_slot + len(keyed), dtype=np.int64)
            req.extend_target, next_slot = len(keyed), next_slot + len(keyed)
            reqs.append(req)
            expanded.append((shown, names))
        plan, _ = build_plan(reqs, [], 272, (256,))
        plan.logit_rows = np.arange(plan.num_tokens, dtype=np.int64)  # every row's logits
        batch = runner.inputs.forward_batch(plan)
        model.vision.splice(plan, batch)
        logits = model(batch, runner.k_layers, runner.v_layers)
        want = torch.cat([_hf_logits(hf_model, ids, [IMAGES[x] for x in names])
                          for ids, names in expanded])  # fmt: skip
    assert plan.mrope_positions is not None and len(plan.image_rows) == 4 + 12 + 4
    assert (logits - want).abs().max().item() < TOLERANCE


def _hf_greedy(hf_model, ids: list[int], images: list[bytes], n: int) -> list[int]:
    """Greedy, never <|image_pad|> (transformers would take it for an image's)."""
    out = []
    for _ in range(n):
        logits = _hf_logits(hf_model, ids + out, images)[-1]
        logits[PAD] = -float("inf")
        out.append(int(logits.argmax()))
    return out


def test_greedy_after_images_matches_transformers(checkpoint, engine):
    """Decoding after one and two images, token for token: alone, batched, and again with
    the prompt (images included) taken from the radix cache."""
    _, hf_model = checkpoint
    cases = [(_prompt("look @ at this"), ["a"]), (_prompt("@ and @: same?"), ["b", "c"])]
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True,
              "logit_bias": {str(PAD): -100.0}}  # fmt: skip
    with one_thread():
        wants = []
        for ids, names in cases:
            shown, _, _ = _rules(engine.model_info["vision"]).items(
                [IMAGES[x] for x in names], ids, 272
            )
            wants.append(_hf_greedy(hf_model, shown, [IMAGES[x] for x in names], 8))
        engine.flush_cache()
        alone = [
            engine.generate(input_ids=ids, sampling_params=params,
                            image_data=[IMAGES[x] for x in names])
            for ids, names in cases
        ]  # fmt: skip
        batched = engine.generate(
            input_ids=[ids for ids, _ in cases], sampling_params=params,
            image_data=[[IMAGES[x] for x in names] for _, names in cases],
        )  # fmt: skip
    assert [r["output_ids"] for r in alone] == wants
    assert [r["output_ids"] for r in batched] == wants
    assert [r["meta_info"]["cached_tokens"] for r in alone] == [0, 0]
    # the batch found both prompts, images and all, in the cache (all but the last token)
    assert [r["meta_info"]["cached_tokens"] for r in batched] == [
        r["meta_info"]["prompt_tokens"] - 1 for r in batched
    ]


def test_image_tokens_are_cached_by_their_pixels(engine):
    """A second turn about the same image reuses the image's KV (and its encoding); the same
    prompt with a different image of the same size shares nothing from the image on."""
    vision = engine.model_info["vision"]
    ids = _prompt("@ what is it?")
    start = len(_prompt("@")) - 2  # the image's first token: after <|vision_start|>
    params = {"max_new_tokens": 2, "temperature": 0}
    engine.flush_cache()
    tower = engine.scheduler.runner.model.vision
    first = engine.generate(input_ids=ids, sampling_params=params, image_data=[IMAGES["a"]])
    encoded = tower.num_encoded
    second_ids = ids + _prompt(" and its colour?")
    second = engine.generate(input_ids=second_ids, sampling_params=params,
                             image_data=[IMAGES["a"]])  # fmt: skip
    assert tower.num_encoded == encoded  # the image's encoding came from the encoder's cache
    other = engine.generate(input_ids=second_ids, sampling_params=params,
                            image_data=[IMAGES["d"]])  # fmt: skip
    assert tower.num_encoded == encoded + 1
    assert first["meta_info"]["cached_tokens"] == 0
    assert second["meta_info"]["cached_tokens"] >= len(ids) - 1 + 4 - 1  # the image's 4 in it
    assert other["meta_info"]["cached_tokens"] == start  # <|vision_start|> and nothing after
    assert vision["image_token_id"] == PAD
