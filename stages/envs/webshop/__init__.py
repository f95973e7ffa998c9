"""WebShop (Yao et al., 2022) on a catalogue generated here and searched with SQLite FTS5 / BM25.

Modules: :mod:`.catalogue` (the product generator), :mod:`.search` (the cached full-text index), :mod:`.tasks`
(instructions from catalogue products), :mod:`.reward` (WebShop's purchase reward), :mod:`.env` (pages, actions and
the :class:`WebShopEnv` text environment).
"""

from stages.envs.registry import ENVIRONMENTS, EnvSpec, register_env
from stages.envs.webshop.env import WebShopEnv
from stages.envs.webshop.search import open_catalogue

__all__ = ["WebShopEnv", "open_catalogue", "register_webshop_envs"]


def register_webshop_envs() -> list[str]:
    """Register ``WebShop`` (6000 products, 15 steps) and ``WebShopSmall`` (1000 products) in the env registry.
    Runs at import of this package; calling it again registers nothing new."""
    specs = {
        "WebShop": EnvSpec(WebShopEnv, {"num_products": 6000, "max_steps": 15},
                           description="WebShop on a generated 6000-product catalogue (30 categories), BM25 search"),
        "WebShopSmall": EnvSpec(WebShopEnv, {"num_products": 1000, "max_steps": 15},
                                description="WebShop on a generated 1000-product catalogue"),
    }
    for tag, spec in specs.items():
        if tag not in ENVIRONMENTS:
            register_env(tag, spec)
    return list(specs)


register_webshop_envs()
