"""The Tinker API's built-in losses, as its documentation defines them: per-token terms summed over a datum.

Every loss reads the learner's logprobs of ``target_tokens`` (``target_logprobs``, shape ``(N,)``, with gradient)
and the datum's ``loss_fn_inputs`` (``weights``; the sampler's ``logprobs``, ``advantages``), and answers the
elementwise loss; the datum's loss is its sum, and a request's loss the sum over its data (no mean: a client that
wants one scales its weights or advantages). ``ratio = exp(target_logprobs - logprobs)`` is the importance ratio
against the sampler. The engine computes each of them (:func:`~tinkergym.backends.torch.losses.policy_loss`, whose log
ratios are bounded at ``±MAX_LOG_RATIO``); this module holds their names, settings and inputs.

============================  ===========================================================================  ==========================
loss                          elementwise loss                                                             ``loss_fn_config``
============================  ===========================================================================  ==========================
``cross_entropy``             ``-target_logprobs * weights``                                               none
``importance_sampling``       ``-ratio * advantages``                                                      none
``ppo``                       ``-min(ratio * A, clip(ratio, low, high) * A)``                              ``clip_low_threshold`` 0.8,
                                                                                                           ``clip_high_threshold`` 1.2
``cispo``                     ``-sg(clip(ratio, low, high)) * target_logprobs * A``                        as ``ppo``
``dro``                       ``-(target_logprobs * A - beta / 2 * (target_logprobs - logprobs) ** 2)``    ``beta`` 0.05
``gspo``                      ``ppo``'s with every token's ratio the sequence ratio                        as ``ppo``
                              ``exp(mean over the masked tokens of sg(target_logprobs) - logprobs)``,
                              carrying its own token's gradient (GSPO-token)
============================  ===========================================================================  ==========================

``gspo``'s mask is ``sequence_ratio_mask`` (non-zero: in the ratio); without it, the tokens with a non-zero
advantage. ``stable_reinforce`` needs sampling-time stability records that this server does not keep: it is refused
(:data:`UNSUPPORTED`), as is ``custom`` (the SDK runs a custom loss on the client through ``forward`` and a
``cross_entropy`` with weights ``-dLoss/dlogprobs``; nothing custom reaches the server).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

#: The losses served, each with its ``loss_fn_config`` keys and their defaults, and the inputs it needs.
LOSSES: dict[str, tuple[dict[str, float], tuple[str, ...]]] = {
    "cross_entropy": ({}, ("target_tokens", "weights")),
    "importance_sampling": ({}, ("target_tokens", "logprobs", "advantages")),
    "ppo": ({"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}, ("target_tokens", "logprobs", "advantages")),
    "cispo": ({"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}, ("target_tokens", "logprobs", "advantages")),
    "dro": ({"beta": 0.05}, ("target_tokens", "logprobs", "advantages")),
    "gspo": ({"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}, ("target_tokens", "logprobs", "advantages")),
}
#: Losses the SDK names that this server refuses, and why.
UNSUPPORTED = {
    "stable_reinforce": "stable_reinforce needs the sampler's stability records (record_stability_info), which this server does not keep; "
                        "use ppo, cispo or gspo for off-policy data",
    "custom": "a custom loss runs on the client (forward_backward_custom sends forward and cross_entropy requests); "
              "server-side custom losses are not offered",
}
#: Inputs a loss may read besides its required ones.
OPTIONAL_INPUTS = {"gspo": ("sequence_ratio_mask",)}


class LossInputError(ValueError):
    """A request this server cannot compute: an unknown loss, a missing input, a config it does not know."""


def check_loss(name: str, config: Mapping[str, Any] | None) -> dict[str, float]:
    """The loss's settings: its defaults with ``config`` applied; an unknown loss or key is a :class:`LossInputError`."""
    if name in UNSUPPORTED:
        raise LossInputError(UNSUPPORTED[name])
    if name not in LOSSES:
        raise LossInputError(f"unknown loss {str(name)[:60]!r}; this server computes {', '.join(LOSSES)}")
    defaults = LOSSES[name][0]
    settings = dict(defaults)
    for key, value in (config or {}).items():
        if key not in defaults:
            known = ", ".join(defaults) or "none"
            raise LossInputError(f"loss_fn_config key {str(key)[:60]!r} is not one of {name}'s (known: {known})")
        try:
            settings[key] = float(value)
        except (TypeError, ValueError):
            raise LossInputError(f"loss_fn_config[{key!r}] must be a number, not {str(value)[:60]!r}") from None
        if not np.isfinite(settings[key]):
            raise LossInputError(f"loss_fn_config[{key!r}] must be finite")
    return settings


def check_inputs(name: str, inputs: Mapping[str, np.ndarray], length: int, where: str) -> None:
    """Each input the loss needs is there with ``length`` entries, and nothing else is sent."""
    needed = LOSSES[name][1]
    allowed = set(needed) | set(OPTIONAL_INPUTS.get(name, ()))
    missing = [k for k in needed if k not in inputs]
    if missing:
        raise LossInputError(f"{where}: the {name} loss needs loss_fn_inputs {', '.join(missing)}")
    extra = sorted(set(inputs) - allowed)
    if extra:
        raise LossInputError(f"{where}: loss_fn_inputs {', '.join(extra)} are not read by the {name} loss (it reads {', '.join(sorted(allowed))})")
    for key, value in inputs.items():
        if value.shape != (length,):
            raise LossInputError(f"{where}: loss_fn_inputs[{key!r}] has shape {list(value.shape)}; it needs ({length},), one per input token")
        if value.dtype.kind == "f" and not np.isfinite(value).all():
            raise LossInputError(f"{where}: loss_fn_inputs[{key!r}] holds NaN or infinite values")
