"""WebShop instructions generated from catalogue products, so every task has a solution (the source product).

``make_goal(index, seed)``: product ``random.Random(seed)`` picks; 1–3 of its attributes (not ones that only repeat
the product type's words); one value of each of its
options; a price limit a little above its price (rounded up to whole dollars). The instruction reads like WebShop's
crowd-sourced ones: "i am looking for a machine washable, slim fit t-shirt with color: navy blue, and size: large,
and price lower than 40.00 dollars".
"""

from __future__ import annotations

import math
import random

from stages.envs.webshop.reward import Goal
from stages.envs.webshop.search import CatalogueIndex

OPENERS = ("i am looking for", "i need", "i want to buy", "find me", "i would like", "i'm looking for",
           "get me")


def make_goal(index: CatalogueIndex, seed: int) -> Goal:
    """The task of episode ``seed``: a goal derived from one catalogue product (deterministic in ``seed``)."""
    rng = random.Random(f"webshop-task-{seed}")
    product = index.product_at(rng.randrange(index.count))
    type_words = set(product.product_type.split())
    pool = [a for a in product.attributes if not set(a.split()) <= type_words] or list(product.attributes)
    attributes = tuple(rng.sample(pool, rng.randint(1, min(3, len(pool)))))
    options = {name: rng.choice(values) for name, values in sorted(product.options.items())}
    price_upper = float(math.ceil(product.price * rng.uniform(1.05, 1.6)))
    if len(attributes) > 1:
        wanted = f"{', '.join(attributes[:-1])} and {attributes[-1]} {product.product_type}"
    else:
        wanted = f"{attributes[0]} {product.product_type}"
    parts = [f"{rng.choice(OPENERS)} {wanted}"]
    if options:
        parts.append("with " + ", and ".join(f"{name}: {value}" for name, value in options.items()))
    parts.append(f"and price lower than {price_upper:.2f} dollars")
    return Goal(asin=product.asin, query=product.query, category=product.category, product_type=product.product_type,
                attributes=attributes, options=options, price_upper=price_upper, instruction=", ".join(parts))
