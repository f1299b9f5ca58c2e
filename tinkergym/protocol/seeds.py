"""The random numbers of a seeded sample request, by sample: what a sample draws depends on the request's seed, its
prompt's place among the request's distinct prompts and its own place among that prompt's samples, and on nothing else.

A sample request with ``params.seed`` set gives each sample its own stream (:func:`sample_seeds`): its prompt's group
is the request's distinct prompts in order of first appearance (copies of one prompt, a GRPO group, are one group; a
prompt with images is a group of its own), the group's seed is :func:`group_seed` (the request's own seed for the first
group), and the group's samples, in order (each copy of the prompt ``num_samples`` times), take the seeds
:func:`row_seeds` gives. The number a sample draws at each decode step is a function of its seed and the step
(:class:`~tinkergym.backends.torch.sampling.SeededRows`). So a sample is the same whether its request is decoded in one
batch or in many, beside other tenants' rows or alone, split across the ranks of a sharded job, or sent through the
Tinker API as one request per distinct prompt (whose seed is that prompt's group seed: :func:`group_seed` of group 0 is
the seed itself). Standard library only: a client without torch computes the group seeds it sends.
"""

from __future__ import annotations

from collections.abc import Sequence

_MASK = 2**64 - 1
_GOLDEN = 0x9E3779B97F4A7C15  # 2**64 / the golden ratio: splitmix64's increment


def mix64(x: int) -> int:
    """splitmix64's finalizer: a bijection of 64-bit integers whose every output bit depends on every input bit."""
    x &= _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def group_seed(seed: int, group: int) -> int:
    """The seed of the ``group``-th distinct prompt of a request seeded ``seed``: ``seed`` itself for the first, so a
    request of one prompt seeded with a group's seed draws what that group draws in the whole request."""
    return seed & _MASK if group == 0 else mix64(seed + group * _GOLDEN) >> 1


def row_seeds(seed: int, count: int) -> list[int]:
    """The seeds of a group's ``count`` samples, in order, from its group seed."""
    return [mix64(seed + (s + 1) * _GOLDEN) for s in range(count)]


def prompt_groups(prompts: Sequence[Sequence[int]], images: Sequence[Sequence[object]] = ()) -> list[list[int]]:
    """The indices of ``prompts`` by distinct prompt, in order of first appearance; a prompt with images is alone."""
    groups: dict[object, list[int]] = {}
    for i, prompt in enumerate(prompts):
        key: object = ("images", i) if i < len(images) and images[i] else tuple(prompt)
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def sample_seeds(prompts: Sequence[Sequence[int]], num_samples: int, seed: int, images: Sequence[Sequence[object]] = ()) -> list[list[int]]:
    """Per prompt of a request seeded ``seed``, the seeds of its ``num_samples`` samples (see the module docstring)."""
    out: list[list[int]] = [[] for _ in prompts]
    for g, rows in enumerate(prompt_groups(prompts, images)):
        seeds = row_seeds(group_seed(seed, g), len(rows) * num_samples)
        for j, i in enumerate(rows):
            out[i] = seeds[j * num_samples : (j + 1) * num_samples]
    return out
