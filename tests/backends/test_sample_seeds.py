"""A seeded sample request's draws by sample (tinkergym.protocol.seeds): what a sample draws depends on the request's seed,
its prompt's group and its place in the group, never on the batches the request is cut into or the prompts beside it."""

from __future__ import annotations

import pytest

from tinkergym.protocol.seeds import group_seed, mix64, prompt_groups, row_seeds, sample_seeds


def test_groups_are_distinct_prompts_in_order_and_a_prompt_with_images_is_alone() -> None:
    assert prompt_groups([[1, 2], [3], [1, 2], [4], [3]]) == [[0, 2], [1, 4], [3]]
    assert prompt_groups([[1], [1], [1]], images=[[], ["image"], []]) == [[0, 2], [1]]


def test_the_first_group_keeps_the_requests_seed_and_copies_take_consecutive_seeds() -> None:
    assert group_seed(12345, 0) == 12345 and group_seed(12345, 1) != group_seed(12345, 2) != 12345
    assert all(0 <= group_seed(s, g) < 2**63 for s in (0, 1, 2**40) for g in range(1, 20))
    seeds = sample_seeds([[1], [2], [1]], num_samples=2, seed=7)
    assert seeds[0] + seeds[2] == row_seeds(7, 4)  # the group's copies, each num_samples, in order
    assert seeds[1] == row_seeds(group_seed(7, 1), 2)
    assert len({s for row in seeds for s in row}) == 6
    # a request of the second group's prompt alone, seeded with that group's seed, draws the same seeds
    assert sample_seeds([[2]], num_samples=2, seed=group_seed(7, 1)) == [seeds[1]]
    assert mix64(0) == 0 and mix64(1) != 1 and mix64(2**64 + 5) == mix64(5)


torch = pytest.importorskip("torch")

from tinkergym.backends.torch.backend import TorchBackend, TorchBackendConfig  # noqa: E402
from tinkergym.backends.torch.sampling import SeededRows, uniforms  # noqa: E402
from tinkergym.protocol.types import SampleRequest, SamplingParams  # noqa: E402


def test_a_rows_numbers_are_a_function_of_its_seed_and_the_step_alone() -> None:
    import numpy as np

    seeds = [3, 2**63 + 11, 0]
    table = uniforms(np.array(seeds, dtype=np.uint64), 5, 4)
    for r, seed in enumerate(seeds):
        for t in range(4):
            assert table[r, t] == (mix64(seed + (5 + t + 1) * 0x9E3779B97F4A7C15) >> 40) / 2**24
    assert ((table >= 0) & (table < 1)).all()
    rows = SeededRows(seeds)
    first = [rows.rand(3, torch.device("cpu"))[:, 0].tolist() for _ in range(70)]  # across the block of STEPS_AHEAD
    rows.set_state(66)
    assert rows.rand(3, torch.device("cpu"))[:, 0].tolist() == first[66]
    alone = SeededRows([seeds[1]])
    assert [alone.rand(1, torch.device("cpu"))[0, 0].item() for _ in range(70)] == [f[1] for f in first]
    with pytest.raises(ValueError, match="3 seeded rows"):
        SeededRows(seeds).rand(2, torch.device("cpu"))


def _tokens(response) -> list[list[list[int]]]:
    return [[s.tokens for s in row] for row in response.sequences]


def test_a_seeded_requests_samples_do_not_depend_on_its_batches_or_its_other_prompts(tiny) -> None:
    def backend(most: int) -> TorchBackend:
        return TorchBackend(TorchBackendConfig(model=tiny, lora_rank=4, dtype="float32", seed=1, max_sample_batch=most))

    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=21)
    a, b = [11, 12, 13], [40, 41]
    request = SampleRequest(prompts=[a, b, a], num_samples=3, params=params)
    wide, narrow = backend(64), backend(2)
    together = _tokens(wide.sample(request))
    assert _tokens(narrow.sample(request)) == together  # 9 sequences in one batch, or in batches of 2
    assert together[0] != together[2] and len({tuple(t) for t in together[0]}) > 1, "copies and samples draw apart"
    alone = SampleRequest(prompts=[b], num_samples=3, params=SamplingParams(**{**params.to_dict(), "seed": group_seed(21, 1)}))
    assert _tokens(narrow.sample(alone)) == [together[1]]
    assert _tokens(wide.sample(request)) == together  # and again: the request's draws, not the backend's generator's
