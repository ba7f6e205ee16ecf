"""The scorers of `dls calibrate --eval FILE --scorer NAME`."""

import pytest

from calibrate.scorers import SCORERS, first_choice, gsm8k_target, last_number


def score(name: str, answer: str, expected: str) -> bool:
    return SCORERS[name].score(answer, expected)


def test_exact_compares_the_stripped_texts():
    assert score("exact", " 936\n", "936") and not score("exact", "9360", "936") and not score("exact", "", "936")


@pytest.mark.parametrize(("answer", "expected", "right"), [
    ("She pays 5 + 3 = 8 dollars.\n#### 8", "Natalia sold 48/2 = 24 clips ... #### 8", True),
    ("The answer is $1,234.00", "#### 1234", True),
    ("18 then 20", "#### 18", False),  # the last number counts
    ("-3", "#### -3", True),
    ("no number", "#### 3", False),
    ("72", "72", True),  # an answer without the marker: its last number
])
def test_gsm8k_compares_the_final_numbers(answer, expected, right):
    assert score("gsm8k", answer, expected) is right


def test_numbers_are_read_as_gsm8k_writes_them():
    assert last_number("a 1,000 b 2.5") == 2.5 and last_number("none") is None
    assert gsm8k_target("12 apples #### 1,200") == 1200 and gsm8k_target("nothing") is None


def test_contains():
    assert score("contains", "the capital is Paris.", " Paris ") and not score("contains", "paris", "Paris")


@pytest.mark.parametrize(("answer", "expected", "right"), [
    ("B", "B", True), ("(C) because", "C", True), ("Answer: D.", "(D)", True), ("Bob says E", "E", True),
    ("I think A is wrong, B", "B", False),  # the first standalone letter
    ("ABC", "A", False), ("", "A", False),
])
def test_choice_takes_the_first_standalone_letter(answer, expected, right):
    assert score("choice", answer, expected) is right
    assert first_choice("x") is None


def test_expected_answers_are_checked_up_front():
    assert SCORERS["gsm8k"].check("#### 12") is None and "no number" in SCORERS["gsm8k"].check("twelve")
    assert SCORERS["choice"].check("b") is None and "no choice letter" in SCORERS["choice"].check("F")
    assert SCORERS["exact"].check("  ") == "the expected answer is empty"
    assert set(SCORERS) >= {"exact", "gsm8k", "contains", "choice"}
