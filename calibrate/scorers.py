"""Scorers of `dls calibrate --eval FILE --scorer NAME`: is an answer text right, given the expected answer?

* ``exact``: the answer, stripped, equals the expected answer, stripped;
* ``gsm8k``: the final number: the expected answer's number after GSM8K's ``####`` (the whole answer
  when it has none), compared numerically with the last number in the answer text (``1,234`` and
  ``$1234.00`` are 1234);
* ``contains``: the expected answer (stripped) occurs in the answer text;
* ``choice``: a multiple-choice letter A-E: the first standalone choice letter of the answer text
  (``B``, ``(B)``, ``B.``, ``Answer: B``) equals the expected letter.

Each scorer also checks an expected answer up front (``check``), so that a file whose answers it cannot
score is refused with the line, before anything is decoded.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?|-?\$?\.\d+")
_CHOICE = re.compile(r"(?<![A-Za-z0-9])([A-E])(?![A-Za-z0-9])")


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", "").replace("$", ""))
    except ValueError:
        return None


def last_number(text: str) -> float | None:
    """The last number written in ``text`` (None when there is none)."""
    found = [n for n in (_number(m) for m in _NUMBER.findall(text)) if n is not None]
    return found[-1] if found else None


def gsm8k_target(expected: str) -> float | None:
    """The number a GSM8K answer ends with (after ``####``), or the last number of a plain answer."""
    _, marker, after = expected.rpartition("####")
    return last_number(after if marker else expected)


def first_choice(text: str) -> str | None:
    found = _CHOICE.search(text)
    return found.group(1) if found else None


def exact(answer: str, expected: str) -> bool:
    return answer.strip() == expected.strip()


def gsm8k(answer: str, expected: str) -> bool:
    target, got = gsm8k_target(expected), last_number(answer)
    return target is not None and got is not None and math.isclose(got, target, rel_tol=0, abs_tol=1e-6)


def contains(answer: str, expected: str) -> bool:
    return expected.strip() in answer


def choice(answer: str, expected: str) -> bool:
    target = first_choice(expected.strip().upper()) if len(expected.strip()) > 1 else expected.strip().upper()
    return target is not None and first_choice(answer) == target


def _check_exact(expected: str) -> str | None:
    return None if expected.strip() else "the expected answer is empty"


def _check_gsm8k(expected: str) -> str | None:
    return None if gsm8k_target(expected) is not None else f"no number in the expected answer {expected[-40:]!r}"


def _check_choice(expected: str) -> str | None:
    text = expected.strip().upper()
    letter = text if len(text) == 1 else first_choice(text)
    return None if letter is not None and letter in "ABCDE" else f"no choice letter A-E in the expected answer {expected!r}"


@dataclass(frozen=True)
class Scorer:
    name: str
    score: Callable[[str, str], bool]  # (answer text, expected answer) -> right
    check: Callable[[str], str | None]  # an expected answer -> why it cannot be scored (None: it can)


SCORERS = {s.name: s for s in (
    Scorer("exact", exact, _check_exact),
    Scorer("gsm8k", gsm8k, _check_gsm8k),
    Scorer("contains", contains, _check_exact),
    Scorer("choice", choice, _check_choice),
)}
