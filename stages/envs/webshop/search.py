"""The catalogue's full-text index: SQLite FTS5 with BM25 ranking (standard library ``sqlite3``).

The index is built once per catalogue into ``<repo>/.cache/webshop/<fingerprint>.sqlite`` (written to a temporary
file and renamed, so concurrent builders never see a partial file) and opened read-only afterwards. The same file
holds the products (JSON by ASIN), so an env process never regenerates the catalogue.

Ranking: FTS5's ``bm25()`` (k1 = 1.2, b = 0.75) over title, description, features, attributes and category, ties
broken by catalogue order. A query is tokenised into lower-case words and searched as ``w1 OR w2 OR ...`` — a
bag-of-words BM25 query like WebShop's pyserini search.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import threading
from functools import lru_cache
from pathlib import Path
from typing import Iterable

from schemas.errors import ConfigError
from stages.envs.webshop.catalogue import Product, catalogue_fingerprint, generate_catalogue

REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_CACHE_DIR = REPO_ROOT / ".cache" / "webshop"
_WORD = re.compile(r"[a-z0-9]+")
_STOPWORDS = frozenset({"a", "an", "and", "are", "as", "at", "be", "by", "for", "from", "i", "in", "is", "it", "me",
                        "my", "need", "of", "on", "or", "than", "that", "the", "this", "to", "with", "want",
                        "looking", "am", "price", "lower", "dollars"})
_BUILD_LOCK = threading.Lock()


def query_terms(query: str) -> list[str]:
    """Lower-case word tokens of ``query`` without stopwords and duplicates, in order (at most 32)."""
    seen: dict[str, None] = {}
    for word in _WORD.findall(str(query).lower()):
        if word not in _STOPWORDS:
            seen.setdefault(word, None)
    return list(seen)[:32]


def fts_query(query: str) -> str | None:
    """An FTS5 MATCH expression for ``query``: quoted terms joined by OR; ``None`` if no term is left."""
    terms = query_terms(query)
    return " OR ".join(f'"{t}"' for t in terms) if terms else None


def _build(path: Path, products: Iterable[Product], fingerprint: str) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    tmp.unlink(missing_ok=True)
    con = sqlite3.connect(tmp)
    try:
        con.executescript("""
            CREATE TABLE products(id INTEGER PRIMARY KEY, asin TEXT UNIQUE NOT NULL, data TEXT NOT NULL);
            CREATE VIRTUAL TABLE products_fts USING fts5(title, description, features, attributes, category,
                                                         tokenize = 'unicode61');
            CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
        """)
        count = 0
        for i, p in enumerate(products, start=1):
            con.execute("INSERT INTO products VALUES (?, ?, ?)", (i, p.asin, p.to_json()))
            con.execute("INSERT INTO products_fts(rowid, title, description, features, attributes, category) "
                        "VALUES (?, ?, ?, ?, ?, ?)", (i, p.title, p.description, " ; ".join(p.features),
                                                      " ; ".join(p.attributes), p.category))
            count = i
        con.execute("INSERT INTO products_fts(products_fts) VALUES ('optimize')")
        con.executemany("INSERT INTO meta VALUES (?, ?)", [("fingerprint", fingerprint), ("count", str(count))])
        con.commit()
    finally:
        con.close()
    os.replace(tmp, path)


class CatalogueIndex:
    """Read-only access to one built catalogue: product lookup by ASIN / position and BM25 search."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._local = threading.local()
        con = self._con()
        self.count = int(con.execute("SELECT value FROM meta WHERE key = 'count'").fetchone()[0])
        self.fingerprint = con.execute("SELECT value FROM meta WHERE key = 'fingerprint'").fetchone()[0]
        self._search = lru_cache(maxsize=4096)(self._search_uncached)
        self._product = lru_cache(maxsize=8192)(self._product_uncached)

    def _con(self) -> sqlite3.Connection:
        con = getattr(self._local, "con", None)
        if con is None:
            con = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, check_same_thread=False)
            self._local.con = con
        return con

    def search(self, query: str, limit: int = 50) -> tuple[str, ...]:
        """ASINs of the best ``limit`` products for ``query`` by BM25 (best first); empty if no term matches."""
        return self._search(fts_query(query), int(limit))

    def _search_uncached(self, match: str | None, limit: int) -> tuple[str, ...]:
        if match is None:
            return ()
        rows = self._con().execute(
            "SELECT p.asin FROM products_fts f JOIN products p ON p.id = f.rowid WHERE products_fts MATCH ? "
            "ORDER BY bm25(products_fts), f.rowid LIMIT ?", (match, limit)).fetchall()
        return tuple(r[0] for r in rows)

    def product(self, asin: str) -> Product | None:
        """The product with this ASIN (case-insensitive), or ``None``."""
        return self._product(str(asin).upper())

    def _product_uncached(self, asin: str) -> Product | None:
        row = self._con().execute("SELECT data FROM products WHERE asin = ?", (asin,)).fetchone()
        return Product.from_json(row[0]) if row else None

    def product_at(self, position: int) -> Product:
        """The product at 0-based catalogue position ``position``."""
        row = self._con().execute("SELECT data FROM products WHERE id = ?", (int(position) + 1,)).fetchone()
        if row is None:
            raise IndexError(f"catalogue position {position} out of range 0..{self.count - 1}")
        return Product.from_json(row[0])


_INDEXES: dict[str, CatalogueIndex] = {}


def open_catalogue(num_products: int = 6000, seed: int = 0, cache_dir: str | Path | None = None) -> CatalogueIndex:
    """The index of the catalogue ``(num_products, seed)``: built into the cache on first use, then reused."""
    directory = Path(cache_dir) if cache_dir is not None else DEFAULT_CACHE_DIR
    fingerprint = catalogue_fingerprint(int(num_products), int(seed))
    path = directory / f"{fingerprint}.sqlite"
    key = str(path)
    index = _INDEXES.get(key)
    if index is not None:
        return index
    with _BUILD_LOCK:
        index = _INDEXES.get(key)
        if index is None:
            if not path.is_file():
                try:
                    directory.mkdir(parents=True, exist_ok=True)
                    _build(path, generate_catalogue(int(num_products), int(seed)), fingerprint)
                except OSError as exc:
                    raise ConfigError(f"WebShop: cannot write the search index to {path} ({exc}); set cache_dir to "
                                      "a writable folder") from None
            index = _INDEXES[key] = CatalogueIndex(path)
    if index.fingerprint != fingerprint:
        raise ConfigError(f"WebShop index {path} belongs to catalogue {index.fingerprint}, not {fingerprint}; delete "
                          "the file so it is rebuilt")
    return index


def product_json(product: Product) -> dict:
    """The product as a plain dict (for info and tests)."""
    return json.loads(product.to_json())
