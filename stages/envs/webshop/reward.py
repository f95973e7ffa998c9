"""WebShop's purchase reward (Yao et al., 2022, §3.2; the reference implementation's ``get_reward``).

    r = r_type · (|U_att ∩ Y_att| + |U_opt ∩ Y_opt| + 1[y_price ≤ u_price]) / (|U_att| + |U_opt| + 1)

``U`` is the goal (instruction), ``Y`` the purchased product with the options chosen. A goal attribute counts as
matched if a product attribute is within fuzzy token-set similarity > 85 of it, or if it occurs in the product's
title, features or description; a goal option counts if a chosen option is within similarity > 85. ``r_type`` is 1
when the purchased product's query equals the goal's, or ≥ 2 category levels agree, or more than 20 % of the goal's
product-type words occur in the purchased type; 0.5 otherwise; 0.1 if under 10 % of the type words agree; 0 if none.
(WebShop picks the type words with spaCy's noun tagger; the catalogue's product types are noun phrases, so every
non-stopword of the type counts.)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Mapping, Sequence

_NON_ALNUM = re.compile(r"[^0-9a-z]+")
_TYPE_STOPWORDS = frozenset({"a", "an", "and", "for", "of", "the", "with", "set"})


def _process(text: str) -> str:
    """thefuzz's ``full_process``: lower case, non-alphanumerics to spaces, stripped."""
    return _NON_ALNUM.sub(" ", str(text).lower()).strip()


def _lcs(a: str, b: str) -> int:
    """Length of the longest common subsequence (the indel distance is ``len(a) + len(b) - 2·lcs``)."""
    if len(a) < len(b):
        a, b = b, a
    previous = [0] * (len(b) + 1)
    for ch in a:
        current = [0]
        for j, other in enumerate(b, 1):
            current.append(previous[j - 1] + 1 if ch == other else max(previous[j], current[j - 1]))
        previous = current
    return previous[-1]


def _ratio(a: str, b: str) -> float:
    """Levenshtein indel similarity in [0, 100]: ``200·lcs / (len(a) + len(b))``."""
    total = len(a) + len(b)
    return 100.0 if total == 0 else 200.0 * _lcs(a, b) / total


@lru_cache(maxsize=65536)
def token_set_ratio(a: str, b: str) -> int:
    """thefuzz/rapidfuzz ``token_set_ratio``: compare the sorted common tokens with each side's full token set.

    0 if either side has no token; 100 when one side's tokens are a subset of the other's.
    """
    ta, tb = set(_process(a).split()), set(_process(b).split())
    if not ta or not tb:
        return 0
    common = " ".join(sorted(ta & tb))
    rest_a, rest_b = " ".join(sorted(ta - tb)), " ".join(sorted(tb - ta))
    if common and (not rest_a or not rest_b):
        return 100
    combined_a = f"{common} {rest_a}".strip()
    combined_b = f"{common} {rest_b}".strip()
    scores = [_ratio(combined_a, combined_b)]
    if common:
        scores += [_ratio(common, combined_a), _ratio(common, combined_b)]
    return int(round(max(scores)))


def type_words(product_type: str) -> set[str]:
    return {w for w in _process(product_type).split() if w not in _TYPE_STOPWORDS}


@dataclass(frozen=True)
class Goal:
    """What an instruction asks for (built from a catalogue product, see ``tasks.py``)."""

    asin: str  # the product the instruction was written from (one solution)
    query: str
    category: str
    product_type: str
    attributes: tuple[str, ...]
    options: Mapping[str, str]
    price_upper: float
    instruction: str


def type_reward(goal: Goal, query: str, category: str, product_type: str) -> float:
    """WebShop's ``r_type`` (module docstring)."""
    query_match = query == goal.query
    levels = {x.strip() for x in category.split("›")}
    category_match = len(levels & {x.strip() for x in goal.category.split("›")}) >= 2
    wanted = type_words(goal.product_type)
    title_score = 0.2 if not wanted else len(type_words(product_type) & wanted) / len(wanted)
    r_type = 1.0 if (query_match or category_match or title_score > 0.2) else 0.5
    if title_score < 0.1:
        r_type = 0.1
    if title_score == 0.0:
        r_type = 0.0
    return r_type


def attribute_matches(goal_attributes: Sequence[str], attributes: Sequence[str], title: str,
                      features: Sequence[str], description: str) -> int:
    """How many goal attributes the product has (fuzzy > 85 against its attributes, else a substring of its text)."""
    text = (title.lower(), " ".join(features).lower(), description.lower())
    matched = 0
    for wanted in goal_attributes:
        if any(token_set_ratio(have, wanted) > 85 for have in attributes) or any(wanted in t for t in text):
            matched += 1
    return matched


def option_matches(goal_options: Sequence[str], chosen: Sequence[str]) -> int:
    """How many goal option values are among the chosen ones (fuzzy > 85)."""
    return sum(1 for wanted in goal_options if any(token_set_ratio(have, wanted) > 85 for have in chosen))


def purchase_reward(goal: Goal, product: Mapping, chosen_options: Mapping[str, str]) -> dict:
    """The reward for buying ``product`` (a catalogue product as a dict) with ``chosen_options``; returns
    ``{"reward", "r_type", "r_att", "r_option", "r_price"}`` (the parts are fractions in [0, 1])."""
    r_type = type_reward(goal, product["query"], product["category"], product["product_type"])
    n_att = attribute_matches(goal.attributes, product["attributes"], product["title"], product["features"],
                              product["description"])
    n_opt = option_matches(list(goal.options.values()), list(chosen_options.values()))
    r_price = 1.0 if float(product["price"]) <= goal.price_upper else 0.0
    total = (n_att + n_opt + r_price) / (len(goal.attributes) + len(goal.options) + 1)
    return {"reward": r_type * total, "r_type": r_type,
            "r_att": n_att / len(goal.attributes) if goal.attributes else 1.0,
            "r_option": n_opt / len(goal.options) if goal.options else 1.0, "r_price": r_price}
