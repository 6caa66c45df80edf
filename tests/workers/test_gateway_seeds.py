"""A gateway call's sampling seed (vLLM servers sample each call with its own): the harness's
when it sends one, else derived from the run's seed and the call's place, so a run asks for
the same samples again and no two calls of a run share one."""

from __future__ import annotations

from workers.gateway.engine import call_seed


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
