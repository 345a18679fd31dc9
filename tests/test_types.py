"""The data model rejects every bad input with a TraceError naming the rollout, turn and field."""

import copy
import math
from array import array

import pytest

from tracetrain.types import (
    LEGAL_TRANSITIONS,
    TERMINAL_STATES,
    Rollout,
    RolloutState,
    TraceError,
    Turn,
    check_rollouts,
)


def good_turn(**kw):
    args = dict(
        prompt_ids=[1, 2, 3], response_ids=[4, 5], response_logprobs=[-0.5, -1.0], model_version=1
    )
    args.update(kw)
    return Turn(**args)


# (field, bad value, words the message must hold)
BAD_TURN_FIELDS = [
    ("prompt_ids", [], ["prompt_ids is empty"]),
    ("response_ids", [], ["response_ids is empty"]),
    ("prompt_ids", [1, -3], ["prompt_ids[1] is -3", ">= 0"]),
    ("response_ids", [-1, 2], ["response_ids[0] is -1"]),
    ("response_ids", [5, 2**63], ["response_ids[1] is 9223372036854775808", "< 2**63"]),
    ("prompt_ids", [1, 2.0], ["prompt_ids[1] is 2.0", "float", "must be int"]),
    ("prompt_ids", [True, 2], ["prompt_ids[0] is True", "bool"]),
    ("response_ids", ["4", 5], ["response_ids[0] is '4'", "str"]),
    ("prompt_ids", (1, 2), ["prompt_ids must be a list", "tuple"]),
    ("response_logprobs", [-0.5], ["response_logprobs has 1 values", "response_ids has 2"]),
    ("response_logprobs", [-0.5, math.nan], ["response_logprobs[1] is nan", "finite"]),
    ("response_logprobs", [math.inf, -1.0], ["response_logprobs[0] is inf"]),
    ("response_logprobs", [-0.5, -math.inf], ["response_logprobs[1] is -inf"]),
    ("response_logprobs", [-0.5, 0.7], ["response_logprobs[1] is 0.7", "<= 0"]),
    ("response_logprobs", [-0.5, True], ["response_logprobs[1] is True"]),
    ("response_logprobs", (-0.5, -1.0), ["response_logprobs must be a list"]),
    ("model_version", -1, ["model_version is -1"]),
    ("model_version", True, ["model_version is True"]),
]


# --- ids and logprobs as array.array (the store's form): the same checks, the same messages
BAD_ARRAY_FIELDS = [
    ("prompt_ids", array("i"), ["prompt_ids is empty"]),
    ("prompt_ids", array("i", [1, -3]), ["prompt_ids[1] is -3", ">= 0"]),
    ("response_ids", array("Q", [5, 2**63]), ["response_ids[1] is 9223372036854775808", "< 2**63"]),
    ("prompt_ids", array("f", [1.0, 2.0]), ["prompt_ids is an array of type code 'f'", "integer"]),
    ("response_logprobs", array("f", [-0.5]), ["response_logprobs has 1 values", "response_ids has 2"]),
    ("response_logprobs", array("d", [-0.5, math.nan]), ["response_logprobs[1] is nan", "finite"]),
    ("response_logprobs", array("f", [-math.inf, -1.0]), ["response_logprobs[0] is -inf", "finite"]),
    ("response_logprobs", array("d", [-0.5, 0.7]), ["response_logprobs[1] is 0.7", "<= 0"]),
    ("response_logprobs", array("i", [0, 0]), ["type code 'i'", "'f' or 'd'"]),
]


@pytest.mark.parametrize("field,value,words", BAD_TURN_FIELDS + BAD_ARRAY_FIELDS)
def test_bad_turn_field_raises_naming_the_field(field, value, words):
    with pytest.raises(TraceError) as e:
        good_turn(**{field: value})
    for w in words:
        assert w in str(e.value)


@pytest.mark.parametrize("field,value,words", BAD_TURN_FIELDS + BAD_ARRAY_FIELDS)
def test_bad_turn_inside_rollout_names_rollout_and_turn(field, value, words):
    bad = good_turn()
    setattr(bad, field, value)  # changed after its own check: the Rollout check catches it
    with pytest.raises(TraceError) as e:
        Rollout("r-7", "g", [good_turn(), bad], reward=1.0)
    msg = str(e.value)
    assert msg.startswith("rollout 'r-7', turn 1: ")
    for w in words:
        assert w in msg


@pytest.mark.parametrize(
    "kw,words",
    [
        (dict(reward=math.nan), ["rollout 'r1'", "reward is nan", "finite"]),
        (dict(reward=math.inf), ["reward is inf"]),
        (dict(reward=-math.inf), ["reward is -inf"]),
        (dict(reward=True), ["reward must be a number", "bool"]),
        (dict(reward="1.0"), ["reward must be a number", "str"]),
        (dict(state="done"), ["rollout 'r1'", "state 'done' is unknown", "succeeded"]),
        (dict(group_id=""), ["rollout 'r1'", "group_id must be a non-empty str"]),
        (dict(rollout_id=""), ["rollout_id must be a non-empty str"]),
        (dict(rollout_id=7), ["rollout_id must be a non-empty str"]),
        (dict(turns=(good_turn(),)), ["rollout 'r1'", "turns must be a list"]),
        (
            dict(turns=[good_turn(), {"prompt_ids": [1]}]),
            ["rollout 'r1'", "turns[1] is a dict, not a Turn"],
        ),
    ],
)
def test_bad_rollout_field_raises_naming_rollout_and_field(kw, words):
    args = dict(rollout_id="r1", group_id="g", turns=[good_turn()], reward=0.5, state="succeeded")
    args.update(kw)
    with pytest.raises(TraceError) as e:
        Rollout(**args)
    for w in words:
        assert w in str(e.value)


def test_duplicate_rollout_ids_in_one_batch_raise_naming_the_id():
    a, b, c = (Rollout(i, "g", [good_turn()], 1.0) for i in ("a", "b", "a"))
    check_rollouts([a, b])  # distinct ids pass
    with pytest.raises(TraceError, match="rollout 'a': rollout_id appears more than once"):
        check_rollouts([a, b, c])


def test_check_rollouts_rejects_a_non_rollout_item():
    with pytest.raises(TraceError, match=r"rollouts\[1\] is a dict, not a Rollout"):
        check_rollouts([Rollout("a", "g", [good_turn()]), {"rollout_id": "b"}])


def test_nothing_is_coerced_and_valid_input_is_kept_as_given():
    ids = [1, 2, 3]
    t = Turn(ids, [4], [-1])  # an int log-probability is a valid number and stays an int
    assert (
        t.prompt_ids is ids and t.response_logprobs == [-1] and type(t.response_logprobs[0]) is int
    )
    r = Rollout("a", "g", [t], reward=1, state="timed_out")
    assert r.state is RolloutState.timed_out and r.reward == 1
    # equal content compares equal (the non-mutation tests rely on dataclass equality)
    assert copy.deepcopy(r) == r


def test_states_and_legal_transitions():
    assert {s for s in RolloutState if s.terminal} == set(TERMINAL_STATES)
    assert {s for s in RolloutState if s.infra_failure} == {
        RolloutState.failed,
        RolloutState.timed_out,
    }
    for s in TERMINAL_STATES:
        assert LEGAL_TRANSITIONS[s] == frozenset()
    assert RolloutState.succeeded not in LEGAL_TRANSITIONS[RolloutState.queued]
    assert RolloutState.succeeded in LEGAL_TRANSITIONS[RolloutState.running]



def test_arrays_are_kept_as_given():
    p, r, lp = array("i", [1, 2, 3]), array("q", [4, 5]), array("f", [-0.5, -1.0])
    t = good_turn(prompt_ids=p, response_ids=r, response_logprobs=lp)
    assert t.prompt_ids is p and t.response_ids is r and t.response_logprobs is lp
