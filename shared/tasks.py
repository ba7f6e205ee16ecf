"""Synthetic reasoning tasks: the stand-in for GSM8K that the bundled model is trained and scored on.

Three families, all checkable without a reference model:

* ``add``: multi-digit addition with carries (``347+589=`` -> ``936``), scored by exact match.
* ``words``: ``@c=`` asks for three words of category ``c``, drawn from the category's weighted word
  list. Several answers are valid; an answer is scored by *validity* (three words, each in the list).
* ``chain``: the long family (35 to 125 tokens: 3 to 8 blocks of 16, 2 to 4 of 32). ``@d.q=`` asks for a chain
  of items labelled ``a`` up to ``q`` (``a:pat b:kan c:sel ... q:bog``): the first word is of
  category ``d``, and each later word's category is set by the last letter of the word before it
  (``CHAIN_NEXT_CATEGORY``), so every word depends on the one before, across block boundaries. An
  item's label follows from its place; where the chain ends, from the query's letter. Scored by
  validity (labels, count, categories and links all right).

The categories are built so that the threshold matters (see ``CATEGORIES``):

  - *independent* categories: every letter position chooses between two letters on its own (80/20
    and the like), so every combination is a word. A low threshold commits all letters of a word in
    one step and is still right: the speed side of the trade-off.
  - *coupled* categories: the words differ from a "favourite" non-word in exactly one position each,
    so every position's most likely letter is the favourite's, and committing all of them at once
    spells the non-word. A threshold below the smallest per-position marginal commits them together
    and fails; a higher one commits one letter, which decides the word. The cliff sits at that
    marginal (0.52 to 0.6 here), so a mix of categories gives a smooth accuracy curve.

Prompts are few-shot: 0 to 8 worked examples (one per line, either family) before the query.
A problem is *held out* by a deterministic hash of its query, so training never sees a held-out
query and evaluation can draw from the held-out split only.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from dataclasses import dataclass
from enum import StrEnum

SEPARATOR = "\n"
WORDS_PER_ANSWER = 3
HELD_OUT_PERCENT = 10


class Family(StrEnum):
    ADD = "add"
    WORDS = "words"
    CHAIN = "chain"


SHORT_FAMILIES = (Family.ADD, Family.WORDS)  # answers of at most 12 tokens; few-shot examples come from these
# the short families' mix: how often a generator without family weights draws each (the mix curves)
SHORT_MIX_WEIGHTS = {Family.ADD: 0.5, Family.WORDS: 0.5}


class Split(StrEnum):
    TRAIN = "train"
    HELD_OUT = "held_out"
    ANY = "any"


@dataclass(frozen=True)
class Category:
    """A weighted word list; ``kind`` is 'independent' or 'coupled'."""

    name: str
    kind: str
    word_to_weight: dict[str, float]  # word -> probability

    def sample_word(self, rng: random.Random) -> str:
        words = list(self.word_to_weight)
        return rng.choices(words, weights=[self.word_to_weight[w] for w in words])[0]


def _independent(name: str, letter_pairs: list[tuple[str, str, float]]) -> Category:
    """Each position picks its first letter with probability p, else the second, independently."""
    word_to_weight: dict[str, float] = {}
    for picks in itertools.product(*[[(a, p), (b, 1 - p)] for a, b, p in letter_pairs]):
        word = "".join(letter for letter, _ in picks)
        weight = 1.0
        for _, p in picks:
            weight *= p
        word_to_weight[word] = weight
    return Category(name, "independent", word_to_weight)


def _coupled(name: str, word_to_weight: dict[str, float]) -> Category:
    return Category(name, "coupled", word_to_weight)


# Category letter -> category. Coupled lists: favourite non-word in the comment, then the smallest
# per-position marginal of the favourite's letters (where the accuracy cliff is).
CATEGORIES: dict[str, Category] = {
    c.name: c
    for c in (
        _independent("a", [("b", "d", 0.8), ("o", "i", 0.8), ("g", "t", 0.8)]),
        _independent("b", [("k", "m", 0.75), ("a", "u", 0.85), ("n", "p", 0.8)]),
        _independent("c", [("s", "z", 0.8), ("e", "y", 0.75), ("l", "r", 0.85)]),
        _coupled("d", {"pat": 0.45, "rot": 0.3, "ram": 0.25}),  # "rat": 0.55
        _coupled("e", {"gin": 0.42, "fan": 0.3, "fix": 0.28}),  # "fin": 0.58
        _coupled("f", {"bone": 0.45, "tine": 0.2, "tore": 0.2, "tons": 0.15}),  # "tone": 0.55
        _coupled("g", {"jug": 0.48, "hog": 0.27, "hum": 0.25}),  # "hug": 0.52
        _coupled("h", {"cave": 0.4, "wove": 0.2, "wake": 0.2, "wavy": 0.2}),  # "wave": 0.6
    )
}


# The chain family: the last letter of a word -> the category of the next word. Every 3-letter
# category can follow; the coupled ones (d, e, g) come up in about 28% of the links, so a long chain
# almost always holds some words that a low threshold breaks.
CHAIN_NEXT_CATEGORY: dict[str, str] = {
    "g": "b", "n": "c", "l": "a", "t": "d", "p": "e", "r": "g", "m": "a", "x": "b",
}
CHAIN_CATEGORIES = ("a", "b", "c", "d", "e", "g")  # the categories whose words all have 3 letters
CHAIN_MIN_ITEMS, CHAIN_MAX_ITEMS = 6, 21  # labels "f" .. "u": answers of 35 .. 125 tokens
CHAIN_LABELS = "abcdefghijklmnopqrstuvwxyz"
# How the long family is served in the long workloads (the simulator's *-long presets, the live long
# workload): LLaDA's block of 32 on a 128-token canvas, so an answer runs 2 to 4 blocks
LONG_CANVAS, LONG_BLOCK_LENGTH = 128, 32


def chain_answer_length(num_items: int) -> int:
    """Characters of a chain answer: ``label:word`` items (5 characters) joined by spaces."""
    return 6 * num_items - 1


@dataclass(frozen=True)
class Problem:
    """One task instance: ``prompt`` (few-shot examples, then ``query``) and a reference answer."""

    family: Family
    query: str
    answer: str
    prompt: str
    num_shots: int

    @property
    def training_text(self) -> str:
        return self.prompt + self.answer


def is_held_out(query: str) -> bool:
    digest = hashlib.blake2b(query.encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") % 100 < HELD_OUT_PERCENT


def check_answer(problem: Problem, answer: str) -> bool:
    """Exact match for ``add``; validity (three words of the category) for ``words``."""
    answer = answer.strip()
    if problem.family is Family.ADD:
        return answer == problem.answer
    if problem.family is Family.CHAIN:
        return _valid_chain(problem.query, answer)
    category = CATEGORIES[problem.query[1]]
    words = answer.split(" ")
    return len(words) == WORDS_PER_ANSWER and all(w in category.word_to_weight for w in words)


def _valid_chain(query: str, answer: str) -> bool:
    """``@{start}.{last}=``: items ``a`` .. ``last``, each word in the category its link sets."""
    start, last = query[1], query[3]
    items = answer.split(" ")
    if len(items) != CHAIN_LABELS.index(last) + 1:
        return False
    category = start
    for index, item in enumerate(items):
        label, _, word = item.partition(":")
        if label != CHAIN_LABELS[index] or word not in CATEGORIES[category].word_to_weight:
            return False
        category = CHAIN_NEXT_CATEGORY.get(word[-1], "")
        if not category:
            return False
    return True


class TaskGenerator:
    """Deterministic, seeded generator of problems with few-shot prompts.

    ``family_weights`` maps family -> relative frequency of queries; ``max_digits`` bounds the
    addition operands. Examples in a prompt are drawn from either family and never from the
    held-out split, whatever split the query comes from. ``chain_length_bias`` weights a chain of
    n items by n ** bias (0: every length alike; training uses it to show the longest chains, whose
    last labels only they hold, more often).
    """

    def __init__(
        self,
        seed: int = 0,
        family_weights: dict[Family, float] | None = None,
        max_digits: int = 3,
        chain_length_bias: float = 0.0,
    ) -> None:
        self._rng = random.Random(seed)
        self._family_weights = family_weights or dict(SHORT_MIX_WEIGHTS)
        self._max_digits = max_digits
        self._chain_lengths = range(CHAIN_MIN_ITEMS, CHAIN_MAX_ITEMS + 1)
        self._chain_length_weights = [n**chain_length_bias for n in self._chain_lengths] if chain_length_bias else None

    def problem(self, num_shots: int, split: Split = Split.TRAIN, family: Family | None = None) -> Problem:
        family = family or self._pick_family()
        query, answer = self._query(family, split)
        examples = [self._example() for _ in range(num_shots)]  # always short, whatever the query
        prompt = "".join(q + a + SEPARATOR for q, a in examples) + query
        return Problem(family, query, answer, prompt, num_shots)

    def problems(self, count: int, max_shots: int, split: Split = Split.TRAIN) -> list[Problem]:
        return [self.problem(self._rng.randint(0, max_shots), split) for _ in range(count)]

    def _pick_family(self) -> Family:
        families = list(self._family_weights)
        return self._rng.choices(families, weights=[self._family_weights[f] for f in families])[0]

    def _example(self) -> tuple[str, str]:
        family = self._pick_family()
        return self._query(family if family in SHORT_FAMILIES else Family.ADD, Split.TRAIN)

    def _query(self, family: Family, split: Split) -> tuple[str, str]:
        if family is Family.WORDS:
            return self._words()  # the held-out idea does not apply: the query is only a category
        if family is Family.CHAIN:
            return self._chain()  # nor here: the query is a category and a length
        while True:
            query, answer = self._addition()
            if split is Split.ANY or is_held_out(query) == (split is Split.HELD_OUT):
                return query, answer

    def _addition(self) -> tuple[str, str]:
        a, b = (self._operand() for _ in range(2))
        return f"{a}+{b}=", str(a + b)

    def _operand(self) -> int:
        # Mostly full-width operands, so most sums carry across several digits.
        digit_counts = range(1, self._max_digits + 1)
        num_digits = self._rng.choices(digit_counts, weights=[d * d for d in digit_counts])[0]
        return self._rng.randint(10 ** (num_digits - 1) if num_digits > 1 else 0, 10**num_digits - 1)

    def _words(self) -> tuple[str, str]:
        category = CATEGORIES[self._rng.choice(sorted(CATEGORIES))]
        words = [category.sample_word(self._rng) for _ in range(WORDS_PER_ANSWER)]
        return f"@{category.name}=", " ".join(words)

    def _chain(self) -> tuple[str, str]:
        start = self._rng.choice(CHAIN_CATEGORIES)
        if self._chain_length_weights is None:
            num_items = self._rng.randint(CHAIN_MIN_ITEMS, CHAIN_MAX_ITEMS)
        else:
            num_items = self._rng.choices(self._chain_lengths, weights=self._chain_length_weights)[0]
        items, category = [], start
        for index in range(num_items):
            word = CATEGORIES[category].sample_word(self._rng)
            items.append(f"{CHAIN_LABELS[index]}:{word}")
            category = CHAIN_NEXT_CATEGORY[word[-1]]
        return f"@{start}.{CHAIN_LABELS[num_items - 1]}=", " ".join(items)
