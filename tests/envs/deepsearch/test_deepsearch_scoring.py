"""Answer normalisation, exact match, token F1 and FanOutQA's answer-set match."""

from __future__ import annotations

import pytest

from agentgym.envs.deepsearch.scoring import (
    answer_items,
    answer_set_recall,
    contains_answer,
    exact_match,
    f1_score,
    normalize_answer,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The Eiffel Tower", "eiffel tower"),
        ("  an   Apple, a day!  ", "apple day"),
        ("Washington, D.C.", "washington dc"),
        ("9,833,520 km2", "9833520 km2"),
        ("THEATRE", "theatre"),  # articles only as whole words
        ("A", ""),
        ("Dā Də Bātorāno Kor", "dā də bātorāno kor"),  # non-ASCII letters kept
        ("tab\tand\nnewline\u00a0nbsp", "tab and newline nbsp"),
        ("", ""),
    ],
)
def test_normalize_answer(text: str, expected: str) -> None:
    assert normalize_answer(text) == expected


@pytest.mark.parametrize(
    ("prediction", "golds", "em"),
    [
        ("Liverpool", ["Liverpool"], 1.0),
        ("the liverpool.", ["Liverpool"], 1.0),
        ("Liverpool, England", ["Liverpool"], 0.0),
        ("Paris", ["London", "paris"], 1.0),
        ("", ["London"], 0.0),
        ("London", [], 0.0),
    ],
)
def test_exact_match(prediction: str, golds: list[str], em: float) -> None:
    assert exact_match(prediction, golds) == em


def test_f1_is_token_overlap_and_best_over_golds() -> None:
    assert f1_score("Liverpool", ["Liverpool"]) == 1.0
    # prediction "liverpool england" vs gold "liverpool": P=1/2, R=1 -> 2/3
    assert f1_score("Liverpool, England", ["Liverpool"]) == pytest.approx(2 / 3)
    assert f1_score("Liverpool, England", ["Manchester", "Liverpool"]) == pytest.approx(2 / 3)
    assert f1_score("the red fox", ["fox red red"]) == pytest.approx(2 * (1.0 * 2 / 3) / (1.0 + 2 / 3))
    assert f1_score("nothing shared", ["Liverpool"]) == 0.0
    assert f1_score("", ["Liverpool"]) == 0.0
    assert f1_score("the", ["a"]) == 1.0  # both normalise to nothing: SQuAD counts that as a match


def test_contains_answer_needs_word_boundaries() -> None:
    assert contains_answer("Moscow is the capital of Russia.", "moscow")
    assert contains_answer("It has 1,463,000 people", "1463000")
    assert not contains_answer("Moscowville", "Moscow")
    assert not contains_answer("anything", "the")  # a gold that normalises to nothing never matches


def test_answer_items_flattens_like_fanoutqa() -> None:
    assert answer_items({"Uranus": "William Herschel", "Neptune": "Johann Galle"}) == [
        "Uranus",
        "William Herschel",
        "Neptune",
        "Johann Galle",
    ]
    assert answer_items(["a", "b", "b", ""]) == ["b"]  # 'a' is an article, '' is nothing; duplicates once
    assert answer_items({"Mercury": 0.38, "Earth": 1}) == ["Mercury", "0.38", "Earth", "1"]
    assert answer_items(True) == ["yes"] and answer_items(False) == ["no"]
    assert answer_items(3) == ["3"]
    assert answer_items(None) == []


def test_answer_set_recall() -> None:
    items = ["Uranus", "William Herschel", "Neptune", "Johann Galle"]
    assert answer_set_recall("Uranus: William Herschel; Neptune: Johann Galle", items) == 1.0
    assert answer_set_recall("Neptune was found by Johann Galle", items) == 0.5
    assert answer_set_recall("", items) == 0.0
    assert answer_set_recall("anything", []) == 0.0
