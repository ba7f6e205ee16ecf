import math

import pytest

from services.worker.engine.request import ConfidenceStats, RequestState, StepResult
from shared.features import (
    ARRIVAL_FEATURE_NAMES,
    FEATURE_NAMES,
    FEATURE_SETS,
    arrival_features,
    features_after_step,
    step_features,
)
from shared.messages.base import StepKind


def test_fourteen_features_in_documented_order():
    assert len(FEATURE_NAMES) == 14
    row = step_features(0.8, 32, 40, 8, 10, 2, ConfidenceStats(0.1, 0.2, 0.3, 0.35, 0.5), block_index=1,
                        predicted_end=21)
    assert dict(zip(FEATURE_NAMES, row, strict=True)) == {
        "threshold": 0.8, "output_length": 32.0, "prompt_length": 40.0, "block_length": 8.0,
        "full_progress": 0.3125, "block_progress": 0.25, "block_index": 1.0, "blocks_left": 2.0,
        "conf_min": 0.1, "conf_q25": 0.2, "conf_median": 0.3, "conf_mean": 0.35, "conf_q75": 0.5,
        "end_blocks_left": 1.0,  # the EOS expected at position 21: in block 2, one after block 1
    }


@pytest.mark.parametrize(("predicted_end", "expected"), [
    (None, math.nan), (32, 2.0), (31, 2.0), (8, 0.0), (3, 0.0), (16, 1.0),
])
def test_end_blocks_left_counts_to_the_expected_eos_block(predicted_end, expected):
    """Canvas 32 in blocks of 8, after block 1: no EOS in the canvas (32) runs to the last block; one
    expected in or before the current block leaves none; unknown is missing."""
    value = step_features(0.9, 32, 4, 8, 12, 4, None, block_index=1, predicted_end=predicted_end)[-1]
    assert (math.isnan(value) and math.isnan(expected)) or value == expected


def test_feature_sets_are_prefixes():
    for names in FEATURE_SETS.values():
        assert FEATURE_NAMES[: len(names)] == names


def test_arrival_row_has_no_progress_and_missing_confidence():
    row = arrival_features(0.9, 16, 30, 8)
    assert row[: len(ARRIVAL_FEATURE_NAMES)] == [0.9, 16.0, 30.0, 8.0]
    assert row[4:8] == [0.0, 0.0, 0.0, 1.0]  # no progress, in block 0 of 2
    assert all(math.isnan(v) for v in row[8:])


def test_confidence_as_sequence_and_bad_length():
    assert step_features(0.5, 8, 4, 8, 0, 0, (1, 1, 1, 1, 1))[8:13] == [1.0] * 5
    with pytest.raises(ValueError):
        step_features(0.5, 8, 4, 8, 0, 0, (1, 1))


def test_short_last_block_reaches_full_block_progress():
    assert step_features(0.5, 12, 4, 8, 12, 4, None, block_size=4)[5] == 1.0


def test_features_after_step_reads_the_decoded_block():
    mask = 1
    state = RequestState("r", [7, 7, 7], [5, 5, 5, 5, 5, mask, mask, mask, mask, mask], block_length=4)
    stats = ConfidenceStats(0.2, 0.3, 0.4, 0.4, 0.5)
    result = StepResult("r", StepKind.CACHE, 1, [4], [5], False, 3, 5, stats, 0.7, predicted_end=7)
    row = features_after_step(state, result, mask)
    assert row[:8] == [0.7, 10.0, 3.0, 4.0, 0.5, 0.25, 1.0, 1.0]  # block 1 of 3: one block left
    assert row[8:] == [0.2, 0.3, 0.4, 0.4, 0.5, 0.0]  # the EOS expected in block 1: no block after it
    assert features_after_step(state, result, mask, threshold=0.95)[0] == 0.95
