"""``save_weights_external`` and ``get_external_weights_urls`` through the real ``tinker`` SDK against ``serve tinker``: the
adapter comes back as a peft folder whose logprobs are the training client's, through signed URLs that need no API key,
reach only that checkpoint's files, and are void once tampered with, expired or deleted; another tenant gets nothing."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

pytest.importorskip("tinker")
pytest.importorskip("peft")

import tinker  # noqa: E402
import torch  # noqa: E402
from tinker import types  # noqa: E402

from tests.tinker_api.test_sdk import SEQUENCES, datum, logprobs_of, sft_batch, trained_client  # noqa: E402


def _download(urls: dict[str, str], folder: Path) -> None:
    for relative, url in urls.items():
        answer = httpx.get(url)  # no API key: the signature is the credential
        assert answer.status_code == 200, (relative, answer.text)
        (folder / relative).parent.mkdir(parents=True, exist_ok=True)
        (folder / relative).write_bytes(answer.content)


@pytest.mark.slow
def test_external_weights_download_as_a_peft_adapter_with_the_trainers_logprobs(cluster: Any, connect: Any, tiny: str, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    service = connect()
    training = trained_client(service, cluster.model, seed=5)
    path = training.save_weights_external("exported").result().path
    assert path == f"tinker://{training.model_id}/external_weights/exported"
    rest = tinker.RestClient(base_url=cluster.url, api_key=cluster.keys["alice"])
    listed = {c.checkpoint_id: c for c in rest.list_checkpoints(training.model_id).result().checkpoints}
    assert listed["external_weights/exported"].checkpoint_type == "external" and listed["external_weights/exported"].size_bytes > 0
    answer = rest.get_external_weights_urls(path).result()
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(answer.urls)
    _download(answer.urls, tmp_path / "adapter")
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["r"] == 4

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32), str(tmp_path / "adapter")).eval()
    for sequence in SEQUENCES:
        with torch.no_grad():
            logits = model(torch.tensor([sequence])).logits[0, :-1].float()
        ours = torch.log_softmax(logits, -1).gather(-1, torch.tensor(sequence[1:])[:, None])[:, 0].numpy()
        served = logprobs_of(training, [datum(sequence, weights=[1.0] * len(sequence))])[0]
        np.testing.assert_allclose(ours, served, atol=1e-5)
    # the training client's further steps do not touch the export
    training.forward_backward(sft_batch(), "cross_entropy")
    training.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    _download(rest.get_external_weights_urls(path).result().urls, tmp_path / "again")
    assert (tmp_path / "again" / "adapter_model.safetensors").read_bytes() == (tmp_path / "adapter" / "adapter_model.safetensors").read_bytes()


@pytest.mark.slow
def test_signed_urls_reach_their_files_alone_and_not_after_tampering_expiry_or_deletion(cluster: Any, connect: Any,
                                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from tinkergym.tinker_api import service as service_module

    client = connect()
    training = client.create_lora_training_client(base_model=cluster.model, rank=4).result()
    path = training.save_weights_external("signed").result().path
    rest = tinker.RestClient(base_url=cluster.url, api_key=cluster.keys["alice"])
    urls = rest.get_external_weights_urls(path).result().urls
    url = urls["adapter_config.json"]
    assert httpx.get(url).status_code == 200
    token = url.rsplit("/", 1)[1]
    payload, mac = token.split(".")
    base = url.rsplit("/", 1)[0]
    flipped = mac[:-1] + ("0" if mac[-1] != "0" else "1")
    for forged in (f"{payload}.{flipped}", payload, f"{payload}.", "x" * 5000, f"{payload[:-2]}.{mac}", "..%2F..%2Fetc%2Fpasswd",
                   f"{payload}%00.{mac}", f"%ED%A0%80.{mac}", f"{payload}.{mac}%00"):
        unstorable = "%00" in forged  # a NUL: refused at the door (400)
        assert httpx.get(f"{base}/{forged}").status_code in ((400,) if unstorable else (403, 404)), forged
    # the URL listing of hostile checkpoint ids, and of another tenant's run, answers a 4xx
    key = {"X-API-Key": cluster.keys["alice"]}
    for checkpoint_id in ("external_weights/..%2F..%2Fkeys.db", "external_weights/a%00b", "external_weights/%ED%A0%80", "x" * 3000,
                          "weights/none"):
        answer = httpx.get(f"{cluster.url}/api/v1/training_runs/{training.model_id}/checkpoints/{checkpoint_id}/external_weights_urls", headers=key)
        assert 400 <= answer.status_code < 500, (checkpoint_id, answer.status_code)
    answer = httpx.get(f"{cluster.url}/api/v1/training_runs/{training.model_id}/checkpoints/external_weights/signed/external_weights_urls",
                       headers={"X-API-Key": cluster.keys["bob"]})
    assert answer.status_code == 404
    # a payload naming another file, with the signature of this one, is refused
    other = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    other[2] = "../../keys.db"
    swapped = base64.urlsafe_b64encode(json.dumps(other, separators=(",", ":")).encode()).decode().rstrip("=")
    assert httpx.get(f"{base}/{swapped}.{mac}").status_code == 403
    # another tenant neither lists nor signs it; a read-only key cannot write one
    bob = tinker.RestClient(base_url=cluster.url, api_key=cluster.keys["bob"])
    with pytest.raises(Exception, match="404|not found"):
        bob.get_external_weights_urls(path).result()
    with pytest.raises(Exception, match="age encryption"):
        training.save_weights_external("sealed", age_encryption_recipients=["age1qqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqq"]).result()
    # external weights are for download: a sampler is made from sampler or training checkpoints
    with pytest.raises(Exception, match="external weights"):
        client.create_sampling_client(model_path=path).result().sample(types.ModelInput.from_ints([5, 6]), 1, types.SamplingParams(max_tokens=2)).result()
    # expired URLs answer nothing
    now = service_module.time.time()
    monkeypatch.setattr(service_module.time, "time", lambda: now + service_module.EXTERNAL_URL_TTL_S + 60)
    assert httpx.get(url).status_code == 403
    monkeypatch.undo()
    assert httpx.get(url).status_code == 200
    # a deleted checkpoint's URLs answer nothing
    rest.delete_checkpoint(training.model_id, "external_weights/signed").result()
    assert httpx.get(url).status_code == 404
