"""Advantage estimators against hand-computed numbers."""

import pytest
from opencomposer.training.advantages import group_advantages


def test_grpo_uses_unbiased_std():
    # mean 0.25, sample std sqrt((0.5625 + 3 * 0.0625) / 3) = 0.5
    adv = group_advantages([1, 0, 0, 0], estimator="grpo", eps=0.0)
    assert adv == pytest.approx([1.5, -0.5, -0.5, -0.5])


def test_dr_grpo_has_no_std_division():
    adv = group_advantages([1, 0, 0, 0], estimator="dr_grpo")
    assert adv == pytest.approx([0.75, -0.25, -0.25, -0.25])


def test_rloo_leave_one_out_baseline():
    adv = group_advantages([1, 0, 0, 0], estimator="rloo")
    assert adv == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3])
    adv = group_advantages([1.0, 0.5, 0.0], estimator="rloo")
    # 1 - 0.25, 0.5 - 0.5, 0 - 0.75
    assert adv == pytest.approx([0.75, 0.0, -0.75])


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_all_equal_groups_are_skipped(estimator):
    assert group_advantages([1, 1, 1, 1], estimator=estimator) is None
    assert group_advantages([0.0, 0.0], estimator=estimator) is None
    assert group_advantages([1.0], estimator=estimator) is None


def test_unknown_estimator_is_one_clear_error():
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        group_advantages([0, 1], estimator="ppo")
