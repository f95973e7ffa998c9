"""WebShop: the scripted shopper gets reward 1, the reward formula by hand, navigation, step limit, stateless
restores, the catalogue generator and the BM25 index against a Python BM25.

The registry-wide contract is in test_contract.py.
"""

from __future__ import annotations

import json
import math
import re
import sqlite3
from collections import Counter

import pytest

from stages.envs import make_env, restore_env
from stages.envs.webshop import WebShopEnv
from stages.envs.webshop.catalogue import CATEGORIES, catalogue_fingerprint, generate_catalogue
from stages.envs.webshop.reward import Goal, purchase_reward, token_set_ratio, type_reward
from stages.envs.webshop.search import fts_query, open_catalogue, query_terms


def act(text: str) -> str:
    return f"<think>shopping</think><answer>{text}</answer>"


def scripted_shopper(env: WebShopEnv):
    """search with the instruction's words, page until the target shows up, pick it, choose its options, buy."""
    goal = env.goal
    yield act(f"search[{goal.instruction}]")
    while goal.asin not in env.page_asins():
        assert env.page_no < env.num_pages(), "target not among the search results"
        yield act("click[next >]")
    yield act(f"click[{goal.asin.lower()}]")
    for value in goal.options.values():
        yield act(f"click[{value}]")
    yield act("click[buy now]")


@pytest.fixture(scope="module")
def shop() -> WebShopEnv:
    return make_env("WebShop")


def test_scripted_policy_buys_the_target_for_reward_one(shop):
    steps = []
    for seed in range(40):
        shop.reset(seed)
        for k, text in enumerate(scripted_shopper(shop), start=1):
            obs, reward, terminated, truncated, info = shop.step(text)
            assert info["metrics"]["action_is_valid"] and info["metrics"]["action_is_effective"], (seed, text, obs)
        assert terminated and not truncated and reward == 1.0 and info["metrics"]["success"], (seed, obs)
        assert info["reward_parts"] == {"reward": 1.0, "r_type": 1.0, "r_att": 1.0, "r_option": 1.0, "r_price": 1.0}
        assert obs.startswith("Thank you for shopping") and k <= shop.max_steps
        steps.append(k)
    assert max(steps) > min(steps)  # the target is not always on the first results page


def _goal(**kw) -> Goal:
    base = dict(asin="B0X", query="t-shirt", category="Clothing › Men › t-shirt", product_type="t-shirt",
                attributes=("machine washable", "slim fit"), options={"color": "navy blue", "size": "large"},
                price_upper=30.0, instruction="...")
    return Goal(**{**base, **kw})


def _product(**kw) -> dict:
    base = dict(query="t-shirt", category="Clothing › Men › t-shirt", product_type="t-shirt",
                attributes=["machine washable", "cotton"], title="Kalo Classic T-Shirt, Machine Washable",
                features=["Machine washable", "Cotton"], description="a shirt", price=25.0)
    return {**base, **kw}


def test_reward_by_hand():
    goal = _goal()
    # 1 of 2 attributes, both options, price ok: (1 + 2 + 1) / (2 + 2 + 1)
    parts = purchase_reward(goal, _product(), {"color": "navy blue", "size": "large"})
    assert parts["reward"] == pytest.approx(4 / 5) and parts["r_att"] == 0.5 and parts["r_type"] == 1.0
    # 'slim fit' found in the description counts; no options chosen; too expensive: (2 + 0 + 0) / 5
    parts = purchase_reward(goal, _product(description="a slim fit shirt", price=31.0), {})
    assert parts["reward"] == pytest.approx(2 / 5) and parts["r_price"] == 0.0 and parts["r_option"] == 0.0
    # wrong type entirely: r_type 0
    hoodie = _product(query="hoodie", product_type="hoodie", category="Shoes › Men › hoodie")
    assert purchase_reward(goal, hoodie, {})["reward"] == 0.0
    # fuzzy option match: "Navy-Blue" equals "navy blue" after processing; "x-large" contains "large" (as WebShop)
    assert purchase_reward(goal, _product(), {"color": "Navy-Blue", "size": "x-large"})["r_option"] == 1.0
    assert purchase_reward(goal, _product(), {"color": "blue", "size": "small"})["r_option"] == 0.5  # token subset
    assert purchase_reward(goal, _product(), {"color": "red", "size": "small"})["r_option"] == 0.0


def test_type_reward_levels():
    goal = _goal(query="running shoes", product_type="running shoes", category="Shoes › Men › running shoes")
    assert type_reward(goal, "running shoes", "Shoes › Men › running shoes", "running shoes") == 1.0
    # same main/sub category (2 levels) and half the type words: 1.0
    assert type_reward(goal, "hiking shoes", "Shoes › Men › hiking shoes", "hiking shoes") == 1.0
    # other category, half the type words (> 0.2): 1.0; other category and no type word: 0
    assert type_reward(goal, "tennis shoes", "Sports › Tennis › tennis shoes", "tennis shoes") == 1.0
    assert type_reward(goal, "sandals", "Shoes › Men › sandals", "sandals") == 0.0
    eleven = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda"
    goal3 = _goal(query="a b c d e f g h i j k", product_type=eleven, category="X › Y › Z")
    # 1 of 11 type words (0.09 < 0.1), no query/category match: 0.1
    assert type_reward(goal3, "q", "P › Q › R", "alpha") == 0.1


def test_token_set_ratio_matches_thefuzz_values():
    assert token_set_ratio("navy blue", "blue navy") == 100
    assert token_set_ratio("navy blue", "navy") == 100  # subset
    assert token_set_ratio("", "navy") == 0
    # no common token: indel ratio of "red" vs "blue": lcs 1 ("e") → 200·1/7 = 28.57 → 29
    assert token_set_ratio("red", "blue") == 29
    # "small" vs "smalll": common none, 200·5/11 = 90.9 → 91
    assert token_set_ratio("small", "smalll") == 91


def test_navigation_and_invalid_actions(shop):
    obs, info = shop.reset(7)
    assert obs.startswith("WebShop [SEP] Instruction: [SEP] ") and info["available_actions"]["has_search_bar"]
    for bad in ["click[buy now]", "search[]", "search for shoes", "", "<answer>click[next >]</answer>"]:
        before = shop.get_state()
        out = shop.step(act(bad) if not bad.startswith("<") else bad)
        assert not out[4]["metrics"]["action_is_valid"] and out[1] == shop.format_penalty == 0.0
        assert json.loads(shop.get_state())["state"]["page"] == "search"
        assert json.loads(shop.get_state())["state"]["steps"] == json.loads(before)["state"]["steps"] + 1
    obs = shop.step(act("SEARCH[ yoga   mat non slip ]"))[0]
    assert "Page 1 (Total results: 50)" in obs and "[Next >]" in obs and "[< Prev]" not in obs
    assert not shop.step(act("search[shoes]"))[4]["metrics"]["action_is_valid"]  # no search bar here
    first = shop.page_asins()
    assert len(first) == 10 and shop.step(act("click[next >]"))[4]["metrics"]["action_is_valid"]
    assert shop.page_no == 2 and set(shop.page_asins()).isdisjoint(first)
    shop.step(act("click[< prev]"))
    assert shop.page_asins() == first
    obs = shop.step(act(f"click[{first[3]}]"))[0]  # upper-case ASIN works too
    assert "[Buy Now]" in obs and shop.page == "item"
    value = next(iter(shop.product().options.values()))[0]
    assert shop.step(act(f"click[{value.upper()}]"))[4]["metrics"]["action_is_effective"]
    again = shop.step(act(f"click[{value}]"))
    assert again[4]["metrics"]["action_is_valid"] and not again[4]["metrics"]["action_is_effective"]
    assert f"[{value}] (selected)" in again[0]
    assert not shop.step(act("click[next >]"))[4]["metrics"]["action_is_valid"]
    shop.step(act("click[< prev]"))
    assert shop.page == "results" and shop.page_no == 1
    shop.step(act("click[back to search]"))
    assert shop.page == "search"


def test_step_limit_truncates():
    env = make_env("WebShop", max_steps=3)
    env.reset(0)
    results = [env.step(act("click[nothing]")) for _ in range(3)]
    assert [r[3] for r in results] == [False, False, True] and not any(r[2] for r in results)
    assert all(r[1] == 0.0 for r in results)


def test_restore_every_turn_equals_live(shop):
    for seed in (3, 4):
        live = make_env("WebShop")
        live.reset(seed)
        state = live.get_state()
        texts = list(scripted_shopper_copy(live, seed))
        for text in texts:
            restored = restore_env(state)
            expected = live.step(text)
            assert restored.step(text) == expected
            state = restored.get_state()
            assert state == live.get_state() and len(state) < 600
        assert expected[1] == 1.0


def scripted_shopper_copy(env: WebShopEnv, seed: int) -> list[str]:
    """The scripted shopper's texts for ``seed``, computed on a separate env."""
    other = make_env("WebShop")
    other.reset(seed)
    texts = []
    for text in scripted_shopper(other):
        texts.append(text)
        other.step(text)
    return texts


def test_instructions_come_from_catalogue_products(shop):
    for seed in range(30):
        shop.reset(seed)
        goal, product = shop.goal, shop.index.product(shop.goal.asin)
        assert set(goal.attributes) <= set(product.attributes)
        assert all(goal.options[k] in product.options[k] for k in goal.options)
        assert product.price <= goal.price_upper and goal.product_type in goal.instruction
        assert f"price lower than {goal.price_upper:.2f} dollars" in goal.instruction


# ---- catalogue and index -------------------------------------------------------------------------------------------
def test_catalogue_is_deterministic_and_varied():
    a, b = list(generate_catalogue(300, seed=1)), list(generate_catalogue(300, seed=1))
    assert a == b and a != list(generate_catalogue(300, seed=2))
    assert len({p.asin for p in a}) == 300 and len(CATEGORIES) >= 25
    assert len({p.category.split(" › ")[0] for p in a}) >= 10 and len({p.product_type for p in a}) >= 80
    assert catalogue_fingerprint(300, 1) == catalogue_fingerprint(300, 1) != catalogue_fingerprint(300, 2)
    for p in a[:50]:
        assert p.title and p.description and 3 <= len(p.attributes) <= 5 and p.options and p.price > 0


def _python_bm25(docs: list[list[str]], terms: list[str], k1: float = 1.2, b: float = 0.75) -> list[float]:
    """Okapi BM25 as FTS5 computes it: idf = ln((N - n + 0.5) / (n + 0.5)) (1e-6 when <= 0), row = all columns."""
    n_docs, avgdl = len(docs), sum(map(len, docs)) / len(docs)
    counts = [Counter(d) for d in docs]
    scores = [0.0] * n_docs
    for term in terms:
        n = sum(1 for c in counts if term in c)
        idf = math.log((n_docs - n + 0.5) / (n + 0.5))
        idf = idf if idf > 0 else 1e-6
        for i, c in enumerate(counts):
            f = c.get(term, 0)
            if f:
                scores[i] += idf * f * (k1 + 1) / (f + k1 * (1 - b + b * len(docs[i]) / avgdl))
    return scores


def test_fts5_ranking_is_bm25(tmp_path):
    index = open_catalogue(400, seed=3, cache_dir=tmp_path)
    con = sqlite3.connect(index.path)
    rows = con.execute("SELECT title, description, features, attributes, category FROM products_fts "
                       "ORDER BY rowid").fetchall()
    asins = [r[0] for r in con.execute("SELECT asin FROM products ORDER BY id")]
    docs = [re.findall(r"[a-z0-9]+", " ".join(r).lower()) for r in rows]
    for query in ["non slip yoga mat purple", "wireless earbuds noise cancelling", "organic green tea lemon",
                  "queen size bed sheet set cooling", "waterproof hiking boots size 9"]:
        scores = _python_bm25(docs, query_terms(query))
        got = index.search(query, 20)
        expected = sorted((i for i in range(len(docs)) if scores[i] > 0), key=lambda i: (-scores[i], i))[:20]
        assert [scores[asins.index(a)] for a in got] == pytest.approx([scores[i] for i in expected], rel=1e-9)
        assert got[0] == asins[expected[0]]
    assert index.search("the and of", 10) == () and fts_query("") is None
    assert index.search('"; DROP TABLE products; --', 5) == index.search("drop table products", 5)


def test_index_is_cached_by_fingerprint(tmp_path):
    index = open_catalogue(120, seed=4, cache_dir=tmp_path)
    assert index.path.name == f"{catalogue_fingerprint(120, 4)}.sqlite" and index.count == 120
    mtime = index.path.stat().st_mtime_ns
    assert open_catalogue(120, seed=4, cache_dir=tmp_path) is index
    assert index.path.stat().st_mtime_ns == mtime and len(list(tmp_path.iterdir())) == 1
    assert index.product(index.product_at(5).asin.lower()) == index.product_at(5)


# ---- rollflow show -------------------------------------------------------------------------------------------------
def show_episode(config_path: str, texts: list[str]) -> str:
    """Play ``texts`` through the rollout's own turn code (fake engine replies) and render the turns as
    ``rollflow show`` does."""
    from schemas.config import load_config
    from schemas.rollout_config import RolloutConfig, turn_section
    from stages.generation.engines import GenResult, load_tokenizer
    from stages.generation.model_store import tiny_random_model_dir
    from stages.rollout.episode import play_turn, reset_row
    from stages.rollout.prompts import ChatFormat
    from stages.rollout.show import _indent, _turn_lines

    tokenizer = load_tokenizer(tiny_random_model_dir())
    config = load_config(RolloutConfig, config_path)
    section, chat = turn_section(config), ChatFormat.of(tokenizer, config.prompt.system_prompt, config.prompt.example_turns())
    row = reset_row(section, chat, 0)
    lines = ["  start:", _indent(row["observation"], "      ")]
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        row = play_turn(section, chat, row, GenResult(request_index=0, sample_index=0, prompt_token_ids=[1],
                                                      response_token_ids=ids, logprobs=[-0.5] * len(ids),
                                                      finish_reason="stop", text=text))
        lines += _turn_lines(row, 400)
        if row["done"]:
            break
    return "\n".join(lines)


def test_renders_in_rollflow_show():
    from schemas.config import load_config
    from schemas.rollout_config import RolloutConfig
    from stages.rollout.episode import level_seed

    config = load_config(RolloutConfig, "configs/webshop.yaml")
    env = make_env("WebShop")
    env.reset(level_seed(config.seed, config.iteration, 0))
    texts = scripted_shopper_copy(env, env.seed)
    text = show_episode("configs/webshop.yaml", texts)
    assert "Instruction: [SEP] " + env.goal.instruction in text and "action: click[buy now] (valid" in text
    assert "episode over: terminated (success)" in text and "reward: +1" in text
