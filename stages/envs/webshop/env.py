"""The WebShop environment (Yao et al., 2022) on the generated catalogue: pages, actions, reward, step limit.

Pages: search → results (10 a page, the best 50 by BM25) → item (options, description, features) → bought.
Actions, one per turn inside ``<answer></answer>`` (ROLL's parser, spec §9.3): ``search[query]`` on the search page;
``click[<asin>]``, ``click[next >]``, ``click[< prev]``, ``click[back to search]`` on a results page;
``click[<option value>]``, ``click[buy now]``, ``click[< prev]`` (back to the results), ``click[back to search]`` on an
item page. Buttons match case-insensitively. An action that does not parse or is not on the page leaves the page as
it is and costs ``format_penalty`` (WebShop: reward 0). ``click[buy now]`` ends the episode with WebShop's reward
(:mod:`stages.envs.webshop.reward`); after ``max_steps`` actions without a purchase the episode is truncated with 0.

State (``get_state``): task seed, page, query, results page number, item ASIN, chosen options, step count — the
goal is regenerated from the seed and the pages from the catalogue index, so the state stays small.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any, Mapping, Sequence

from schemas.errors import ConfigError
from stages.envs.base import EnvStateError, TextEnv, check_seed, fresh_seed, step_info
from stages.envs.parser import DEFAULT_ACTION_PATTERN, DEFAULT_SPECIAL_TOKENS, ActionParser
from stages.envs.webshop.catalogue import Product
from stages.envs.webshop.reward import Goal, purchase_reward
from stages.envs.webshop.search import CatalogueIndex, open_catalogue, product_json
from stages.envs.webshop.tasks import make_goal

SEP = " [SEP] "
INSTRUCTION = ("You are shopping on WebShop. Find and buy the product the instruction at the top of each page asks "
               "for, with the requested options, within the price limit. Give exactly one action per turn inside "
               "<answer></answer>: search[your query] on the search page, or click[button] with a button shown in "
               "brackets on the page — an item id such as click[B0ABCD1234], an option such as click[navy blue], "
               "click[buy now], click[next >], click[< prev] or click[back to search]. Example: "
               "<answer>search[machine washable cotton t-shirt]</answer>")
_ACTION = re.compile(r"^\s*(search|click)\s*\[(.*)\]\s*$", re.IGNORECASE | re.DOTALL)
PAGES = ("search", "results", "item", "done")


@lru_cache(maxsize=8192)
def _goal(index: CatalogueIndex, seed: int) -> Goal:
    return make_goal(index, seed)


class WebShopEnv(TextEnv):
    """WebShop on a generated catalogue (module docstring). ``num_products``/``catalogue_seed`` name the catalogue
    (its index is cached under ``cache_dir``, default ``<repo>/.cache/webshop``)."""

    def __init__(self, num_products: int = 6000, catalogue_seed: int = 0, cache_dir: str | None = None,
                 results_per_page: int = 10, max_results: int = 50, max_steps: int = 15,
                 format_penalty: float = 0.0, env_instruction: str | None = None,
                 action_pattern: str | None = DEFAULT_ACTION_PATTERN,
                 special_token_list: Sequence[str] | None = DEFAULT_SPECIAL_TOKENS) -> None:
        if int(results_per_page) < 1 or int(max_results) < 1 or int(max_steps) < 1:
            raise ConfigError(f"WebShop: results_per_page, max_results and max_steps must be >= 1, got "
                              f"{results_per_page}, {max_results}, {max_steps}; fix the env_config")
        self.index = open_catalogue(int(num_products), int(catalogue_seed), cache_dir)
        self.results_per_page, self.max_results = int(results_per_page), int(max_results)
        self.max_steps, self.format_penalty = int(max_steps), float(format_penalty)
        self.env_instruction = env_instruction if env_instruction is not None else INSTRUCTION
        self.parser = ActionParser(action_pattern, None, special_token_list) if action_pattern else None
        self.special_tokens = tuple(special_token_list or ())
        self._set_config({"num_products": num_products, "catalogue_seed": catalogue_seed, "cache_dir": cache_dir,
                          "results_per_page": self.results_per_page, "max_results": self.max_results,
                          "max_steps": self.max_steps, "format_penalty": self.format_penalty,
                          "env_instruction": env_instruction, "action_pattern": action_pattern,
                          "special_token_list": special_token_list})
        self._clear()

    def _clear(self) -> None:
        self.seed: int | None = None
        self.goal: Goal | None = None
        self.page, self.query, self.page_no, self.asin = "search", "", 1, ""
        self.chosen: dict[str, str] = {}
        self.step_count = 0
        self.reward = 0.0

    # ---- episode -------------------------------------------------------------------------------------------------
    def reset(self, seed: int | None = None) -> tuple[str, dict]:
        seed = check_seed(seed, "WebShop.reset")
        self._clear()
        self.seed = fresh_seed() if seed is None else seed
        self.goal = _goal(self.index, self.seed)
        return self.render(), {"env_instruction": self.get_instructions(),
                               "available_actions": self.available_actions()}

    def _parse(self, text: str) -> tuple[dict, str | None, str]:
        """(parser info, verb, argument) — verb ``None`` when the response holds no search[...]/click[...]."""
        if self.parser is not None:
            parsed = self.parser(text)
            info, content = parsed.as_info(), parsed.action_content
        else:
            content = text if isinstance(text, str) else ""
            for token in self.special_tokens:
                content = content.replace(token, "")
            content = content.strip()
            info = {"action": content, "action_content": content, "think_content": ""}
        match = _ACTION.match(content) if content else None
        if match is None:
            info["action"] = None
            return info, None, ""
        return info, match.group(1).lower(), " ".join(match.group(2).split())

    def step(self, action_text: str) -> tuple[str, float, bool, bool, dict]:
        if self.goal is None:
            raise EnvStateError("WebShop.step() called before reset(seed); reset the env first")
        self.step_count += 1
        info, verb, arg = self._parse(action_text)
        if self.page == "done":
            out = step_info(info, valid=False, effective=False, success=False, format_penalty=self.format_penalty,
                            action_desc=f"At turn {self.step_count}, the purchase was already made.")
            return self.render(), 0.0, True, False, out
        before = self._dynamic_state()
        parts = self._apply(verb, arg) if verb is not None else None
        valid = parts is not None
        if not valid:
            info["action"] = None
        bought = self.page == "done"
        reward = (self.reward if bought else 0.0) if valid else self.format_penalty
        truncated = not bought and self.step_count >= self.max_steps
        effective = valid and self._dynamic_state() != {**before, "steps": self.step_count}
        desc = (f"At turn {self.step_count}, you did {verb}[{arg}]." if valid
                else f"At turn {self.step_count}, that action is not available on this page.")
        out = step_info(info, valid=valid, effective=effective, success=bought and self.reward >= 1.0,
                        format_penalty=0.0 if valid else self.format_penalty, action_desc=desc)
        out["available_actions"] = self.available_actions()
        if bought:
            out["reward_parts"] = parts
        return self.render(), float(reward), bought, truncated, out

    def _apply(self, verb: str, arg: str) -> dict | None:
        """Apply a parsed action; ``None`` if it is not available on the current page (nothing changes)."""
        key = arg.lower()
        if verb == "search":
            if self.page != "search" or not arg:
                return None
            self.page, self.query, self.page_no, self.asin, self.chosen = "results", arg, 1, "", {}
            return {}
        if key == "back to search" and self.page in ("results", "item"):
            self.page, self.query, self.page_no, self.asin, self.chosen = "search", "", 1, "", {}
            return {}
        if self.page == "results":
            asins = self.page_asins()
            if key == "next >" and self.page_no < self.num_pages():
                self.page_no += 1
                return {}
            if key == "< prev" and self.page_no > 1:
                self.page_no -= 1
                return {}
            hit = next((a for a in asins if a.lower() == key), None)
            if hit is not None:
                self.page, self.asin, self.chosen = "item", hit, {}
                return {}
            return None
        if self.page == "item":
            product = self.product()
            if key == "< prev":
                self.page, self.asin, self.chosen = "results", "", {}
                return {}
            if key == "buy now":
                parts = purchase_reward(self.goal, product_json(product), self.chosen)
                self.page, self.reward = "done", float(parts["reward"])
                return parts
            for name, values in sorted(product.options.items()):
                value = next((v for v in values if v.lower() == key), None)
                if value is not None:
                    self.chosen = {**self.chosen, name: value}
                    return {}
        return None

    # ---- pages ---------------------------------------------------------------------------------------------------
    def results(self) -> tuple[str, ...]:
        """The ASINs of the current query's results (best first, at most ``max_results``)."""
        return self.index.search(self.query, self.max_results)

    def num_pages(self) -> int:
        return max(1, -(-len(self.results()) // self.results_per_page))

    def page_asins(self) -> tuple[str, ...]:
        start = (self.page_no - 1) * self.results_per_page
        return self.results()[start:start + self.results_per_page]

    def product(self) -> Product:
        product = self.index.product(self.asin)
        if product is None:
            raise EnvStateError(f"WebShop state names item {self.asin}, which is not in this catalogue; restore the "
                                "state with the env_config that produced it")
        return product

    def available_actions(self) -> dict:
        """WebShop's ``{has_search_bar, clickables}`` for the current page."""
        if self.page == "search":
            return {"has_search_bar": True, "clickables": ["search"]}
        if self.page == "results":
            nav = ["back to search"] + (["< prev"] if self.page_no > 1 else []) + (
                ["next >"] if self.page_no < self.num_pages() else [])
            return {"has_search_bar": False, "clickables": nav + [a.lower() for a in self.page_asins()]}
        if self.page == "item":
            values = [v for _, vs in sorted(self.product().options.items()) for v in vs]
            return {"has_search_bar": False, "clickables": ["back to search", "< prev", *values, "buy now"]}
        return {"has_search_bar": False, "clickables": []}

    def render(self) -> str:
        if self.goal is None:
            raise EnvStateError("WebShop.render() called before reset(seed); reset the env first")
        head = ["WebShop", "Instruction:", self.goal.instruction]
        if self.page == "search":
            return SEP.join(head + ["[Search]"])
        if self.page == "results":
            results = self.results()
            nav = ["[Back to Search]", f"Page {self.page_no} (Total results: {len(results)})"]
            nav += ["[< Prev]"] if self.page_no > 1 else []
            nav += ["[Next >]"] if self.page_no < self.num_pages() else []
            items = []
            for asin in self.page_asins():
                p = self.index.product(asin)
                items += [f"[{asin}]", p.title, f"${p.price:.2f}"]
            return SEP.join(head + nav + (items or ["No results."]))
        product = self.product()
        if self.page == "item":
            body = ["[Back to Search]", "[< Prev]"]
            for name, values in sorted(product.options.items()):
                body.append(name)
                body += [f"[{v}]" + (" (selected)" if self.chosen.get(name) == v else "") for v in values]
            body += [product.title, f"Price: ${product.price:.2f}", "Rating: N.A.",
                     f"Description: {product.description}", "Features: " + "; ".join(product.features), "[Buy Now]"]
            return SEP.join(head + body)
        chosen = ", ".join(f"{k}: {v}" for k, v in sorted(self.chosen.items())) or "none"
        return SEP.join(["Thank you for shopping with us!", f"You bought: [{product.asin}] {product.title}",
                         f"Options: {chosen}", f"Price: ${product.price:.2f}",
                         "Your score (min 0.0, max 1.0)", f"{self.reward:.4f}"])

    def get_instructions(self) -> str:
        return self.env_instruction

    # ---- state ---------------------------------------------------------------------------------------------------
    def _started(self) -> bool:
        return self.goal is not None

    def _dynamic_state(self) -> dict:
        state: dict[str, Any] = {"seed": self.seed, "page": self.page, "steps": self.step_count}
        if self.page != "search":
            state.update(query=self.query, page_no=self.page_no)
        if self.page in ("item", "done"):
            state.update(asin=self.asin, options=dict(self.chosen))
        if self.page == "done":
            state["reward"] = self.reward
        return state

    def _load_dynamic_state(self, state: Mapping[str, Any]) -> None:
        try:
            seed, page, steps = int(state["seed"]), str(state["page"]), int(state["steps"])
            query, page_no = str(state.get("query", "")), int(state.get("page_no", 1))
            asin, options = str(state.get("asin", "")), {str(k): str(v) for k, v in state.get("options", {}).items()}
            reward = float(state.get("reward", 0.0))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise EnvStateError(f"WebShop state is malformed ({exc!r}); pass the string get_state() returned") \
                from None
        if page not in PAGES:
            raise EnvStateError(f"WebShop state has page '{page}', expected one of {PAGES}")
        self._clear()
        self.seed, self.goal = seed, _goal(self.index, seed)
        self.page, self.query, self.page_no, self.asin, self.chosen = page, query, page_no, asin, options
        self.step_count, self.reward = steps, reward
