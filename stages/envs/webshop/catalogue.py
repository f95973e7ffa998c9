"""A generated WebShop catalogue: products over tens of categories, deterministic by ``(num_products, seed)``.

Every product has an ASIN-like id, a category path (``Main › Sub › Leaf``, the leaf is the product type), a search
``query`` (its product type, WebShop's "query" field), a title, a description, feature bullets, attributes (phrases
such as ``machine washable``), options (``{"color": [...], "size": [...]}``) and a price. The vocabulary
(categories.yaml beside this module) was written for rollflow; the structure follows WebShop (Yao et al., 2022).
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

import yaml

GENERATOR_VERSION = 1


def _categories(path: Path) -> tuple[tuple, ...]:
    """The categories of the vocabulary file ``path`` (categories.yaml beside this module), each as (main, sub,
    product types, attribute pool, option dims {name: values}, price range, title words)."""
    rows = yaml.safe_load(path.read_text(encoding="utf-8"))
    return tuple((row["main"], row["sub"], tuple(row["product_types"]), tuple(row["attributes"]),
                  {name: tuple(values) for name, values in row["options"].items()}, tuple(row["price"]),
                  tuple(row["title_words"])) for row in rows)


CATEGORIES = _categories(Path(__file__).with_name("categories.yaml"))
BRAND_SYLLABLES = ("ka", "lo", "mi", "ra", "ve", "zu", "no", "ti", "sa", "pe", "do", "ly", "qu", "an", "el", "or",
                   "fi", "ba", "ce", "xo")
DESCRIPTION_OPENERS = ("Designed for everyday use,", "Made to last,", "Our customers' favourite:", "Upgrade your "
                       "routine:", "Built with care,", "Simple and practical,")


@dataclass(frozen=True)
class Product:
    """One catalogue item (JSON-able via :meth:`to_json`)."""

    asin: str
    category: str  # "Main › Sub › product type"
    query: str  # the product type: WebShop's search query the product was collected under
    product_type: str
    title: str
    description: str
    features: tuple[str, ...]
    attributes: tuple[str, ...]
    options: dict = field(default_factory=dict)  # option name -> tuple of values
    price: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @staticmethod
    def from_json(text: str) -> "Product":
        data = json.loads(text)
        data["features"], data["attributes"] = tuple(data["features"]), tuple(data["attributes"])
        data["options"] = {k: tuple(v) for k, v in data["options"].items()}
        return Product(**data)


def catalogue_fingerprint(num_products: int, seed: int) -> str:
    """Names one generated catalogue (generator version, size, seed, vocabulary): 16 hex characters."""
    payload = json.dumps([GENERATOR_VERSION, num_products, seed, CATEGORIES, BRAND_SYLLABLES, DESCRIPTION_OPENERS])
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def _asin(rng: random.Random, used: set[str]) -> str:
    alphabet = "ABCDEFGHJKLMNPQRSTUVWXYZ0123456789"
    while True:
        asin = "B0" + "".join(rng.choice(alphabet) for _ in range(8))
        if asin not in used:
            used.add(asin)
            return asin


def _brand(rng: random.Random) -> str:
    return "".join(rng.choice(BRAND_SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()


def _product(rng: random.Random, category: tuple, used: set[str]) -> Product:
    main, sub, types, attribute_pool, option_dims, (low, high), title_words = category
    product_type = rng.choice(types)
    attributes = tuple(rng.sample(attribute_pool, rng.randint(3, 5)))
    options = {name: tuple(sorted(rng.sample(values, rng.randint(2, min(6, len(values)))),
                                  key=values.index))
               for name, values in option_dims.items()}
    price = round(rng.uniform(low, high), 2)
    brand = _brand(rng)
    shown = attributes[: rng.randint(1, 2)]
    title = f"{brand} {rng.choice(title_words).title()} {product_type.title()}, {', '.join(a.title() for a in shown)}"
    opener = rng.choice(DESCRIPTION_OPENERS)
    rest = ", ".join(attributes[1:])
    description = (f"{opener} this {product_type} from {brand} is {attributes[0]}"
                   + (f" and {rest}." if rest else ".") + f" Part of our {sub.lower()} {main.lower()} range.")
    features = tuple(f"{a.capitalize()}" for a in attributes) + tuple(
        f"Available {name}s: {', '.join(values)}" for name, values in options.items())
    return Product(asin=_asin(rng, used), category=f"{main} › {sub} › {product_type}", query=product_type,
                   product_type=product_type, title=title, description=description, features=features,
                   attributes=attributes, options=options, price=price)


def generate_catalogue(num_products: int = 6000, seed: int = 0) -> Iterator[Product]:
    """``num_products`` products, categories drawn round-robin then shuffled, all from ``random.Random(seed)``."""
    if int(num_products) < 1:
        raise ValueError(f"num_products must be >= 1, got {num_products}")
    rng = random.Random(seed)
    used: set[str] = set()
    for i in range(int(num_products)):
        yield _product(rng, CATEGORIES[i % len(CATEGORIES)], used)
