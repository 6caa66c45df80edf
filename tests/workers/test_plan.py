from workers.pipeline.plan import PlannedInput, build_plan, total_steps


def _inputs(n: int) -> list[PlannedInput]:
    return [PlannedInput(id=str(i), index=i, input_text=f"t{i}", context=None) for i in range(n)]


def test_plan_covers_each_epoch_and_is_reproducible() -> None:
    plan = build_plan(_inputs(5), groups_per_step=2, num_epochs=2, max_steps=None, seed=7)
    assert len(plan) == total_steps(5, 2, 2, None) == 6
    assert [(b.step, b.epoch, b.epoch_step) for b in plan][:4] == [
        (0, 0, 0),
        (1, 0, 1),
        (2, 0, 2),
        (3, 1, 0),
    ]
    assert all(len(b.items) == 2 for b in plan)
    first_epoch = {i.index for b in plan[:3] for i in b.items}
    assert first_epoch == set(range(5))
    again = build_plan(_inputs(5), groups_per_step=2, num_epochs=2, max_steps=None, seed=7)
    assert again == plan
    other = build_plan(_inputs(5), groups_per_step=2, num_epochs=2, max_steps=None, seed=8)
    assert other != plan
    # Epochs are shuffled differently.
    assert [i.index for b in plan[:3] for i in b.items] != [
        i.index for b in plan[3:] for i in b.items
    ]


def test_max_steps_bounds_the_plan() -> None:
    plan = build_plan(_inputs(3), groups_per_step=1, num_epochs=100, max_steps=7, seed=0)
    assert len(plan) == 7 and plan[-1].epoch == 2
    assert build_plan([], groups_per_step=1, num_epochs=1, max_steps=None, seed=0) == []


def test_max_steps_sets_the_number_of_steps_beyond_num_epochs() -> None:
    """As in TRL, max_steps overrides num_epochs: 4 inputs, 2 per step, 1 epoch and
    max_steps=6 train 6 steps over 3 epochs (it used to stop at step 2 without a word)."""
    plan = build_plan(_inputs(4), groups_per_step=2, num_epochs=1, max_steps=6, seed=3)
    assert len(plan) == total_steps(4, 2, 1, 6) == 6
    assert [(b.step, b.epoch, b.epoch_step) for b in plan] == [
        (0, 0, 0),
        (1, 0, 1),
        (2, 1, 0),
        (3, 1, 1),
        (4, 2, 0),
        (5, 2, 1),
    ]
    for epoch in range(3):  # each epoch is a full pass over the inputs
        assert sorted(i.index for b in plan if b.epoch == epoch for i in b.items) == [0, 1, 2, 3]
    # Fewer steps than the epochs would take: max_steps still decides.
    assert len(build_plan(_inputs(4), groups_per_step=2, num_epochs=5, max_steps=3, seed=3)) == 3
    assert total_steps(0, 2, 1, 6) == 0  # no inputs, no steps
