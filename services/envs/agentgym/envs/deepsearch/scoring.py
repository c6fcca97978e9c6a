"""Answer scoring: the usual QA normalisation, exact match, token F1, and FanOutQA's answer-set match.

`normalize_answer` is the SQuAD / Search-R1 normalisation (lowercase, drop ASCII punctuation,
drop the articles a/an/the, collapse whitespace), so scores compare with Search-R1's and the paper's.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

_PUNCTUATION = str.maketrans("", "", string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """Lowercase, strip punctuation and articles, collapse whitespace."""
    lowered = text.lower().translate(_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", lowered).split())


def exact_match(prediction: str, golden_answers: Iterable[str]) -> float:
    """1.0 when the normalised prediction equals any normalised gold answer, else 0.0."""
    predicted = normalize_answer(prediction)
    return float(any(predicted == normalize_answer(gold) for gold in golden_answers))


def f1_score(prediction: str, golden_answers: Iterable[str]) -> float:
    """The best token-level F1 (SQuAD) of the prediction against any gold answer."""
    predicted = normalize_answer(prediction).split()
    best = 0.0
    for gold in golden_answers:
        best = max(best, _token_f1(predicted, normalize_answer(gold).split()))
    return best


def _token_f1(predicted: Sequence[str], gold: Sequence[str]) -> float:
    if not predicted or not gold:
        return float(predicted == gold)
    common = Counter(predicted) & Counter(gold)
    overlap = sum(common.values())
    if overlap == 0:
        return 0.0
    precision = overlap / len(predicted)
    recall = overlap / len(gold)
    return 2 * precision * recall / (precision + recall)


def contains_answer(text: str, answer: str) -> bool:
    """Whether the normalised answer occurs in the normalised text on word boundaries."""
    needle = normalize_answer(answer)
    return bool(needle) and f" {needle} " in f" {normalize_answer(text)} "


def answer_items(answer: Any) -> list[str]:
    """The strings an answer-set match looks for (FanOutQA's accuracy): list items, dict keys and
    values, recursively; booleans as yes/no; items that normalise to nothing are dropped; order kept,
    duplicates removed."""
    found: dict[str, None] = {}

    def walk(value: Any) -> None:
        if isinstance(value, Mapping):
            for key, item in value.items():
                walk(key)
                walk(item)
        elif isinstance(value, list | tuple):
            for item in value:
                walk(item)
        elif isinstance(value, bool):
            found.setdefault("yes" if value else "no", None)
        elif value is not None:
            text = str(value).strip()
            if normalize_answer(text):
                found.setdefault(text, None)

    walk(answer)
    return list(found)


def answer_set_recall(prediction: str, items: Sequence[str]) -> float:
    """The share of `items` found in the prediction (FanOutQA's loose accuracy); 0 when no items."""
    if not items:
        return 0.0
    return sum(contains_answer(prediction, item) for item in items) / len(items)
