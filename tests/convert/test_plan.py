"""Layer plans: which layers become linear (ratio + placement, measured, explicit lists) and their errors."""

import pytest

from linearize.convert.plan import (
    FULL,
    LINEAR,
    choose_softmax,
    describe,
    parse_layers,
    parse_ratio,
    plan_layers,
    softmax_count,
)


def softmax_indices(types):
    return [i for i, t in enumerate(types) if t == FULL]


# ---- ratios --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ratio, layers, n_softmax",
    [("3:1", 30, 8), ("1:1", 30, 15), ("1:0", 30, 0), ("3:1", 4, 1), ("1:1", 4, 2), ("1:0", 4, 0), ("2:1", 30, 10)],
)
def test_ratio_sets_the_softmax_share(ratio, layers, n_softmax):
    types = plan_layers(layers, ratio=ratio)
    assert len(types) == layers
    assert types.count(FULL) == n_softmax
    assert types.count(LINEAR) == layers - n_softmax
    assert set(types) <= {FULL, LINEAR}


def test_small_plans_exactly():
    assert describe(plan_layers(4, "3:1")) == "LLLS"
    assert describe(plan_layers(4, "1:1")) == "LSLS"
    assert describe(plan_layers(4, "1:0")) == "LLLL"
    assert describe(plan_layers(4, "3:1", placement="top")) == "LLLS"
    assert describe(plan_layers(4, "1:1", placement="top")) == "LLSS"


def test_parse_ratio_accepts_spaces():
    assert parse_ratio("3:1") == (3, 1)
    assert parse_ratio(" 1 : 0 ") == (1, 0)


def test_spread_places_softmax_evenly_through_depth():
    softmax = softmax_indices(plan_layers(30, "3:1", placement="spread"))
    assert len(softmax) == 8
    assert softmax[-1] == 29  # the last layer of the last group
    gaps = [b - a for a, b in zip(softmax, softmax[1:])]
    assert set(gaps) <= {3, 4}  # 30 layers / 8 groups: every 3rd or 4th layer
    # 1:1 alternates linear and softmax.
    assert describe(plan_layers(30, "1:1")) == "LS" * 15


def test_top_keeps_softmax_in_the_top_layers():
    assert softmax_indices(plan_layers(30, "3:1", placement="top")) == list(range(22, 30))


def test_measured_keeps_softmax_where_transfer_matched_worst():
    errors = [0.1, 0.9, 0.2, 0.5]
    assert softmax_indices(plan_layers(4, "1:1", placement="measured", layer_scores=errors)) == [1, 3]
    assert softmax_indices(plan_layers(4, "3:1", placement="measured", layer_scores=errors)) == [1]
    errors30 = [0.01 * i for i in range(30)]
    errors30[3], errors30[17] = 5.0, 4.0  # two bad layers among a rising trend
    softmax = softmax_indices(plan_layers(30, "3:1", placement="measured", layer_scores=errors30))
    assert softmax == [3, 17, 24, 25, 26, 27, 28, 29]


def test_measured_needs_one_error_per_layer():
    with pytest.raises(ValueError, match="measured placement needs one score per layer"):
        plan_layers(4, "1:1", placement="measured", layer_scores=None)
    with pytest.raises(ValueError, match="measured placement needs one score per layer"):
        plan_layers(4, "1:1", placement="measured", layer_scores=[0.1, 0.2])


def test_keep_softmax_is_always_softmax_and_counts_toward_the_share():
    types = plan_layers(30, "3:1", keep_softmax=[0, 1])
    softmax = softmax_indices(types)
    assert softmax[:2] == [0, 1]
    assert len(softmax) == 8  # the ratio's share, of which two are the kept layers
    # more kept layers than the ratio asks for: exactly the kept ones
    assert softmax_indices(plan_layers(4, "3:1", keep_softmax=[0, 1])) == [0, 1]
    assert softmax_indices(plan_layers(4, "1:0", keep_softmax=[2])) == [2]
    # measured placement never picks a kept layer twice and fills the rest by error
    errors = [9.0, 0.1, 0.8, 0.2]
    assert choose_softmax(4, (1, 1), "measured", keep_softmax=[0], layer_scores=errors) == [0, 2]


def test_explicit_linear_layers_win_over_ratio():
    types = plan_layers(4, "1:1", linear_layers="0,2")
    assert describe(types) == "LSLS"
    assert plan_layers(4, None, linear_layers=[3, 0, 3]) == [LINEAR, FULL, FULL, LINEAR]
    assert describe(plan_layers(4, "3:1", linear_layers=" 1, 2 ")) == "SLLS"
    assert parse_layers("2,0,2", 4) == [0, 2]


def test_plan_marks_linear_and_softmax_layers():
    types = plan_layers(4, ratio="3:1")
    assert types == [LINEAR, LINEAR, LINEAR, FULL]
    assert describe(types) == "LLLS"
    assert describe(["sliding_attention", LINEAR, FULL]) == "WLS"  # W: a sliding-window softmax layer


def test_softmax_count_rounds_half_up():
    assert softmax_count(30, (3, 1)) == 8  # 7.5 -> 8
    assert softmax_count(4, (3, 1)) == 1
    assert softmax_count(30, (1, 0)) == 0


# ---- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["3-1", "a:b", "", "3:1:1", "3", "-1:1", "1.5:1"])
def test_malformed_ratio_is_a_clear_error(bad):
    with pytest.raises(ValueError, match=r"malformed ratio .*use LINEAR:SOFTMAX, e\.g\. 3:1"):
        plan_layers(30, bad)


def test_ratio_without_linear_layers_is_refused():
    with pytest.raises(ValueError, match=r"ratio '0:1' leaves no layer linear"):
        parse_ratio("0:1")
    with pytest.raises(ValueError, match="leaves no layer linear"):
        plan_layers(30, "0:1")


def test_ratio_that_rounds_to_all_softmax_is_refused():
    with pytest.raises(ValueError, match="the plan makes no layer linear"):
        plan_layers(4, "1:100")
    with pytest.raises(ValueError, match="the plan makes no layer linear"):
        plan_layers(2, "1:0", keep_softmax=[0, 1])


@pytest.mark.parametrize("layers", ["0,4", "4", "-1", [0, 30]])
def test_layer_index_out_of_range_names_the_layer_count(layers):
    n = 30 if layers == [0, 30] else 4
    with pytest.raises(ValueError, match=rf"out of range: the model has {n} layers \(0-{n - 1}\)"):
        plan_layers(n, "3:1", linear_layers=layers)


def test_keep_softmax_out_of_range_names_the_layer_count():
    with pytest.raises(ValueError, match=r"layer index 7 out of range: the model has 4 layers"):
        plan_layers(4, "3:1", keep_softmax=[7])


@pytest.mark.parametrize("empty", ["", ",", " , ", []])
def test_empty_layer_list_is_an_error(empty):
    with pytest.raises(ValueError, match="the layer list is empty"):
        parse_layers(empty, 4)
    # given explicitly (not None) it is an error too, not a silent fall-back to the ratio
    with pytest.raises(ValueError, match="the layer list is empty"):
        plan_layers(4, "3:1", linear_layers=empty)


def test_malformed_layer_list():
    with pytest.raises(ValueError, match=r"malformed layer list '0,a': use comma-separated indices"):
        parse_layers("0,a", 4)


def test_no_plan_at_all():
    with pytest.raises(ValueError, match=r"no layer plan: pass --ratio"):
        plan_layers(4, None)


def test_unknown_placement():
    with pytest.raises(ValueError, match="unknown placement 'middle'"):
        plan_layers(4, "1:1", placement="middle")
