"""The seeds requests to vLLM servers carry: a LoRA run's group requests (``n`` choices each)
and a gateway run's calls. Derived from the run's seed and the request's place, so a run asks
for the same samples again, and spread by a hash so that requests' choices rarely share a seed
(vLLM seeds a request's choices seed, seed + 1, ...)."""

from __future__ import annotations

import itertools

from workers.gateway.engine import call_seed
from workers.ml.vllm_server import group_seed, request_seed


def _ask(slot: int = 0, seq: int = 1, issue: int = 1, **request: object) -> dict[str, object]:
    return {"slot": slot, "seq": seq, "issue": issue, "request": request}


def test_the_harnesss_seed_is_the_calls() -> None:
    assert call_seed(42, "train", 3, _ask(seed=7)) == 7
    assert call_seed(42, "train", 3, _ask(seed=-1)) == 2**63 - 1  # any int OpenAI takes
    assert call_seed(42, "train", 3, _ask(seed=True)) == call_seed(42, "train", 3, _ask())


def test_a_derived_seed_is_the_same_for_the_same_place_and_differs_elsewhere() -> None:
    seed = call_seed(42, "train", 3, _ask())
    assert seed == call_seed(42, "train", 3, _ask())
    assert seed is not None and 0 <= seed < 2**31
    others = [
        call_seed(43, "train", 3, _ask()),
        call_seed(42, "eval", 3, _ask()),
        call_seed(42, "train", 4, _ask()),
        call_seed(42, "train", 3, _ask(slot=1)),
        call_seed(42, "train", 3, _ask(issue=2)),
        call_seed(42, "train", 3, _ask(seq=2)),
    ]
    assert len({seed, *others}) == 7


def test_an_api_that_does_not_say_the_place_leaves_the_call_unseeded() -> None:
    assert call_seed(42, "train", 3, {"issue": 1, "request": {}}) is None


def test_the_choices_of_a_runs_group_requests_rarely_share_a_seed() -> None:
    # 200 steps of 4 ranks x 16 groups of 64 rollouts. Requests seeded by counting (1, 2, 3,
    # ...) would share 63 of each request's 64 choice seeds with a neighbour's; spread by a
    # hash, a few choices of the 819,200 do.
    n = 64
    seeds = [
        request_seed(42, step, rank, group) + j
        for step, rank, group in itertools.product(range(200), range(4), range(16))
        for j in range(n)
    ]
    shared = len(seeds) - len(set(seeds))
    assert shared / len(seeds) < 1e-3, shared
    assert request_seed(42, 3, 0, 1) == request_seed(42, 3, 0, 1)
    assert all(0 <= s < 2**31 for s in seeds[::n])


def test_an_evaluations_group_requests_draw_other_seeds_than_the_next_training_steps() -> None:
    # Both generate at the same global step; a training request's seed is its place's alone.
    train = [group_seed(42, 3, 0, g, evaluation=False) for g in range(16)]
    evaluation = [group_seed(42, 3, 0, g, evaluation=True) for g in range(16)]
    assert not set(train) & set(evaluation)
    assert train == [request_seed(42, 3, 0, g) for g in range(16)]
