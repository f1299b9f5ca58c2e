"""Images in the Backend protocol: round trips through JSON and the training server's argument checks, their bounds,
and text-only requests unchanged on the wire."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tinkergym.errors import ConfigError
from tinkergym.protocol.types import (
    MAX_IMAGE_PIXELS,
    MAX_IMAGES,
    Datum,
    ForwardBackwardRequest,
    ImageData,
    SampleRequest,
)


def _image(seed: int, height: int = 5, width: int = 7) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)


def _pixels(image: ImageData) -> np.ndarray:
    return np.frombuffer(image.pixels(), dtype=np.uint8).reshape(image.height, image.width, 3)


def test_images_round_trip_through_json_pixel_for_pixel() -> None:
    arrays = [_image(1), _image(2, 3, 4)]
    request = SampleRequest(prompts=[[1, 2, 3], [4]], images=[[ImageData.from_array(a) for a in arrays], []])
    back = SampleRequest.from_dict(json.loads(json.dumps(request.to_dict())))
    assert back == request
    assert [_pixels(i).tolist() for i in back.images[0]] == [a.tolist() for a in arrays]
    assert back.images[1] == []

    train = ForwardBackwardRequest(data=[Datum(tokens=[1, 2], loss_mask=[0.0, 1.0], images=[ImageData.from_array(arrays[1])])])
    back_train = ForwardBackwardRequest.from_dict(json.loads(json.dumps(train.to_dict())))
    assert back_train == train
    assert _pixels(back_train.data[0].images[0]).tolist() == arrays[1].tolist()


def test_text_only_requests_carry_no_images_key() -> None:
    sample = SampleRequest(prompts=[[1, 2]]).to_dict()
    train = ForwardBackwardRequest(data=[Datum(tokens=[1, 2], loss_mask=[0.0, 1.0])]).to_dict()
    assert set(sample) == {"prompts", "params", "num_samples"}
    assert set(train["data"][0]) == {"tokens", "loss_mask", "advantages", "sampling_logprobs", "old_logprobs"}
    with_images = SampleRequest(prompts=[[1, 2]], images=[[ImageData.from_array(_image(0))]]).to_dict()
    assert "images" in with_images


def test_images_pass_the_training_servers_argument_checks() -> None:
    from tinkergym.serve.training.calls import parse_call

    image = ImageData.from_array(_image(3))
    request = SampleRequest(prompts=[[1, 2]], images=[[image]])
    parsed = parse_call("sample", json.loads(json.dumps({"request": request.to_dict()})), vocab_size=10)
    assert parsed.args["request"].images == [[image]]
    datum = Datum(tokens=[1, 2], loss_mask=[0.0, 1.0], images=[image, image])
    parsed = parse_call("forward_backward", json.loads(json.dumps({"request": ForwardBackwardRequest(data=[datum]).to_dict()})), vocab_size=10)
    assert parsed.args["request"].data[0].images == [image, image]
    bad = request.to_dict()
    bad["images"][0][0]["height"] = "five"
    with pytest.raises(ConfigError, match="height"):
        parse_call("sample", {"request": bad}, vocab_size=10)


def test_image_bounds_are_refused_with_clear_errors() -> None:
    image = ImageData.from_array(_image(4))
    ImageData.from_array(np.zeros((1, MAX_IMAGE_PIXELS, 3), dtype=np.uint8))  # exactly at the bound: accepted
    with pytest.raises(ValueError, match="larger than"):
        ImageData.from_array(np.zeros((1, MAX_IMAGE_PIXELS + 1, 3), dtype=np.uint8))
    SampleRequest(prompts=[[1]], images=[[image] * MAX_IMAGES])
    with pytest.raises(ValueError, match=f"at most {MAX_IMAGES}"):
        SampleRequest(prompts=[[1]], images=[[image] * (MAX_IMAGES + 1)])
    with pytest.raises(ValueError, match=f"at most {MAX_IMAGES}"):
        Datum(tokens=[1], loss_mask=[0.0], images=[image] * (MAX_IMAGES + 1))
    with pytest.raises(ValueError, match="one list per prompt"):
        SampleRequest(prompts=[[1], [2]], images=[[image]])
    with pytest.raises(ValueError, match="base64 characters"):
        ImageData(height=2, width=2, data="AAAA")
    with pytest.raises(ValueError, match="uint8"):
        ImageData.from_array(np.zeros((2, 2, 3), dtype=np.float32))
    with pytest.raises(ValueError, match="not base64"):
        ImageData(height=1, width=1, data="!!!!").pixels()
