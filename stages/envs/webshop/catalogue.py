"""A generated WebShop catalogue: products over tens of categories, deterministic by ``(num_products, seed)``.

Every product has an ASIN-like id, a category path (``Main › Sub › Leaf``, the leaf is the product type), a search
``query`` (its product type, WebShop's "query" field), a title, a description, feature bullets, attributes (phrases
such as ``machine washable``), options (``{"color": [...], "size": [...]}``) and a price. The vocabulary below was
written for rollflow; the structure follows WebShop (Yao et al., 2022).
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict, dataclass, field
from typing import Iterator

GENERATOR_VERSION = 1

COLORS = ("black", "white", "navy blue", "gray", "red", "green", "beige", "brown", "pink", "purple", "light blue",
          "olive", "yellow", "orange", "silver", "gold", "burgundy", "teal")
CLOTHING_SIZES = ("x-small", "small", "medium", "large", "x-large", "xx-large")
SHOE_SIZES = ("6", "6.5", "7", "7.5", "8", "8.5", "9", "9.5", "10", "10.5", "11", "12")

# (main, sub, product types, attribute pool, option dims {name: values}, price range, title words)
CATEGORIES: tuple[tuple, ...] = (
    ("Clothing", "Men", ("t-shirt", "polo shirt", "hoodie"),
     ("machine washable", "cotton", "slim fit", "short sleeve", "long sleeve", "moisture wicking", "quick dry",
      "button closure", "relaxed fit", "breathable"), {"color": COLORS, "size": CLOTHING_SIZES}, (9, 60),
     ("classic", "everyday", "athletic", "casual")),
    ("Clothing", "Women", ("dress", "blouse", "cardigan"),
     ("machine washable", "polyester", "v-neck", "button closure", "floral print", "long sleeve", "elastic waist",
      "lightweight", "loose fit", "hand wash only"), {"color": COLORS, "size": CLOTHING_SIZES}, (15, 90),
     ("elegant", "summer", "boho", "casual")),
    ("Clothing", "Activewear", ("yoga pants", "running shorts", "sports bra"),
     ("high waist", "moisture wicking", "four way stretch", "quick dry", "tummy control", "with pockets",
      "squat proof", "breathable", "anti chafe"), {"color": COLORS, "size": CLOTHING_SIZES}, (12, 55),
     ("performance", "training", "seamless", "compression")),
    ("Shoes", "Men", ("running shoes", "loafers", "hiking boots"),
     ("non slip", "rubber sole", "memory foam", "waterproof", "lightweight", "lace up", "arch support",
      "slip resistant", "leather"), {"color": COLORS[:10], "size": SHOE_SIZES}, (30, 150),
     ("trail", "comfort", "walking", "outdoor")),
    ("Shoes", "Women", ("sandals", "ankle boots", "sneakers", "ballet flats"),
     ("non slip", "rubber sole", "open toe", "memory foam", "faux leather", "ankle strap", "block heel",
      "slip on", "lightweight"), {"color": COLORS[:12], "size": SHOE_SIZES}, (20, 120),
     ("fashion", "platform", "comfort", "casual")),
    ("Beauty", "Skin Care", ("face moisturizer", "facial cleanser", "eye cream", "sunscreen"),
     ("paraben free", "for sensitive skin", "fragrance free", "hyaluronic acid", "vitamin c", "cruelty free",
      "oil free", "spf 50", "natural ingredients", "long lasting"), {"size": ("1 fl oz", "1.7 fl oz", "3.4 fl oz",
                                                                              "6.7 fl oz")}, (8, 70),
     ("hydrating", "daily", "gentle", "brightening")),
    ("Beauty", "Hair Care", ("shampoo", "conditioner", "hair oil", "hair mask"),
     ("sulfate free", "for dry hair", "argan oil", "paraben free", "color safe", "natural ingredients",
      "for curly hair", "cruelty free", "keratin"), {"size": ("8 fl oz", "12 fl oz", "16 fl oz", "33.8 fl oz")},
     (7, 45), ("repair", "volumizing", "nourishing", "salon")),
    ("Beauty", "Makeup", ("lipstick", "foundation", "mascara", "eyeshadow palette"),
     ("long lasting", "waterproof", "cruelty free", "matte finish", "vegan", "smudge proof", "high pigment",
      "travel size", "for sensitive skin"), {"color": ("nude", "red", "pink", "coral", "berry", "brown", "black",
                                                        "ivory", "beige")}, (6, 50),
     ("velvet", "pro", "silky", "radiant")),
    ("Home & Kitchen", "Bedding", ("bed sheet set", "duvet cover", "pillowcases", "weighted blanket"),
     ("machine washable", "microfiber", "deep pocket", "wrinkle resistant", "cooling", "hypoallergenic",
      "100% cotton", "breathable", "fade resistant"), {"color": COLORS[:12], "size": ("twin", "full", "queen",
                                                                                       "king", "california king")},
     (20, 130), ("luxury", "soft", "hotel", "cozy")),
    ("Home & Kitchen", "Furniture", ("office chair", "bookshelf", "coffee table", "tv stand"),
     ("easy assembly", "solid wood", "metal frame", "height adjustable", "storage space", "lumbar support",
      "space saving", "living room", "mid century"), {"color": ("black", "white", "walnut", "oak", "gray",
                                                                  "espresso", "rustic brown")}, (45, 320),
     ("modern", "industrial", "ergonomic", "minimalist")),
    ("Home & Kitchen", "Kitchen", ("chef knife", "cutting board", "nonstick frying pan", "mixing bowls"),
     ("dishwasher safe", "stainless steel", "bpa free", "easy clean", "non stick", "heat resistant",
      "ergonomic handle", "oven safe", "food grade"), {"size": ("small", "medium", "large", "set of 3")},
     (10, 110), ("professional", "premium", "everyday", "kitchen")),
    ("Home & Kitchen", "Decor", ("wall art", "throw pillow covers", "table lamp", "artificial plant"),
     ("living room", "bedroom", "ready to hang", "handmade", "modern design", "farmhouse", "fade resistant",
      "easy install", "eco friendly"), {"color": COLORS[:14], "size": ("12x12 inch", "16x16 inch", "18x18 inch",
                                                                          "24x36 inch")}, (9, 95),
     ("boho", "rustic", "decorative", "vintage")),
    ("Home & Kitchen", "Storage", ("storage bins", "shoe rack", "closet organizer", "laundry basket"),
     ("collapsible", "space saving", "easy assembly", "with lids", "stackable", "heavy duty", "foldable",
      "with handles", "bpa free"), {"color": ("white", "gray", "beige", "black", "clear")}, (12, 80),
     ("sturdy", "multi purpose", "fabric", "home")),
    ("Electronics", "Audio", ("wireless earbuds", "bluetooth speaker", "over ear headphones", "soundbar"),
     ("noise cancelling", "long battery life", "water resistant", "bluetooth 5.3", "fast charging",
      "built in microphone", "deep bass", "portable", "touch control"), {"color": ("black", "white", "navy blue",
                                                                                  "silver", "red")}, (19, 250),
     ("true wireless", "stereo", "hi-fi", "sport")),
    ("Electronics", "Accessories", ("phone case", "usb c cable", "wireless charger", "screen protector"),
     ("fast charging", "shockproof", "scratch resistant", "braided", "magnetic", "slim", "tempered glass",
      "drop protection", "compatible with iphone"), {"color": COLORS[:10], "size": ("3 ft", "6 ft", "10 ft")},
     (6, 45), ("rugged", "clear", "premium", "durable")),
    ("Electronics", "Computers", ("wireless mouse", "mechanical keyboard", "laptop stand", "usb hub"),
     ("ergonomic", "rgb backlit", "plug and play", "aluminum", "rechargeable", "silent click", "portable",
      "adjustable height", "compatible with mac"), {"color": ("black", "white", "silver", "gray", "pink")},
     (12, 140), ("gaming", "office", "compact", "pro")),
    ("Electronics", "Smart Home", ("smart plug", "security camera", "video doorbell", "smart light bulb"),
     ("works with alexa", "night vision", "motion detection", "two way audio", "no hub required",
      "energy monitoring", "easy install", "weatherproof", "dimmable"), {"size": ("1 pack", "2 pack", "4 pack")},
     (15, 180), ("wifi", "indoor", "outdoor", "smart")),
    ("Sports & Outdoors", "Camping", ("camping tent", "sleeping bag", "camping lantern", "hammock"),
     ("waterproof", "lightweight", "easy setup", "portable", "rechargeable", "compact", "for 4 person",
      "windproof", "carry bag included"), {"color": ("green", "orange", "blue", "gray", "olive")}, (18, 220),
     ("backpacking", "family", "ultralight", "outdoor")),
    ("Sports & Outdoors", "Fitness", ("yoga mat", "adjustable dumbbells", "resistance bands", "jump rope"),
     ("non slip", "extra thick", "eco friendly", "carrying strap", "adjustable", "anti slip", "heavy duty",
      "for home gym", "latex free"), {"color": ("purple", "black", "blue", "pink", "green", "gray"),
                                      "size": ("light", "medium", "heavy")}, (10, 160),
     ("workout", "exercise", "training", "premium")),
    ("Sports & Outdoors", "Cycling", ("bike helmet", "bike light", "cycling gloves", "bike lock"),
     ("adjustable", "rechargeable", "lightweight", "breathable", "high visibility", "waterproof",
      "anti theft", "padded", "quick release"), {"color": ("black", "white", "red", "blue", "neon yellow"),
                                                  "size": ("small", "medium", "large")}, (12, 90),
     ("road", "mountain", "urban", "safety")),
    ("Toys & Games", "Building", ("building blocks set", "magnetic tiles", "marble run"),
     ("stem educational", "for kids 3+", "non toxic", "compatible with major brands", "storage box included",
      "creative", "bpa free", "for boys and girls"), {"size": ("60 pieces", "100 pieces", "250 pieces")},
     (14, 90), ("creative", "classic", "deluxe", "junior")),
    ("Toys & Games", "Games", ("board game", "jigsaw puzzle", "card game"),
     ("for family", "for adults", "2-6 players", "for kids 8+", "travel size", "strategy", "party game",
      "educational", "1000 pieces"), {"size": ("standard edition", "deluxe edition")}, (9, 60),
     ("family", "classic", "fun", "strategy")),
    ("Pet Supplies", "Dogs", ("dog bed", "dog leash", "dog harness", "chew toy"),
     ("machine washable", "orthopedic", "no pull", "reflective", "for large dogs", "durable", "non slip bottom",
      "for small dogs", "adjustable"), {"color": ("black", "gray", "brown", "blue", "red", "pink"),
                                         "size": ("small", "medium", "large", "x-large")}, (9, 85),
     ("comfy", "heavy duty", "calming", "pet")),
    ("Pet Supplies", "Cats", ("cat tree", "cat litter box", "cat toy", "scratching post"),
     ("easy clean", "for indoor cats", "sisal", "odor control", "stable base", "multi level", "interactive",
      "enclosed", "for kittens"), {"color": ("beige", "gray", "white", "black")}, (8, 120),
     ("cozy", "modern", "deluxe", "kitty")),
    ("Grocery", "Snacks", ("protein bars", "trail mix", "granola", "beef jerky"),
     ("gluten free", "high protein", "non gmo", "low sugar", "keto friendly", "vegan", "individually wrapped",
      "no artificial flavors", "kosher"), {"flavor": ("chocolate", "peanut butter", "vanilla", "honey",
                                                        "original", "berry", "sea salt"),
                                            "size": ("6 count", "12 count", "24 count")}, (6, 40),
     ("healthy", "crunchy", "natural", "organic")),
    ("Grocery", "Beverages", ("green tea", "ground coffee", "sparkling water", "herbal tea"),
     ("organic", "caffeine free", "sugar free", "non gmo", "fair trade", "decaf", "zero calories",
      "medium roast", "whole bean"), {"flavor": ("original", "lemon", "peach", "mint", "vanilla", "berry"),
                                      "size": ("12 pack", "24 pack", "2 pound", "12 ounce")}, (5, 45),
     ("premium", "smooth", "refreshing", "classic")),
    ("Health", "Vitamins", ("multivitamin", "fish oil", "vitamin d3", "probiotic"),
     ("gluten free", "non gmo", "vegan", "third party tested", "easy to swallow", "sugar free",
      "dairy free", "high potency", "once daily"), {"size": ("60 count", "120 count", "180 count")}, (8, 55),
     ("daily", "advanced", "complete", "natural")),
    ("Office Products", "Writing", ("gel pens", "notebook", "highlighters", "desk organizer"),
     ("quick dry", "smooth writing", "acid free paper", "assorted colors", "refillable", "no bleed",
      "college ruled", "durable cover", "fine point"), {"color": ("black", "blue", "assorted", "pastel"),
                                                         "size": ("pack of 6", "pack of 12", "pack of 24")},
     (5, 35), ("premium", "student", "office", "colorful")),
    ("Automotive", "Interior", ("car seat cover", "car phone mount", "floor mats", "trunk organizer"),
     ("universal fit", "waterproof", "easy install", "non slip", "foldable", "all weather", "strong suction",
      "breathable", "heavy duty"), {"color": ("black", "gray", "beige", "red")}, (10, 90),
     ("premium", "custom", "durable", "universal")),
    ("Garden", "Tools", ("garden hose", "pruning shears", "garden gloves", "plant pots"),
     ("heavy duty", "rust resistant", "ergonomic handle", "drainage holes", "lightweight", "expandable",
      "leak proof", "puncture resistant", "uv resistant"), {"color": ("green", "black", "terracotta", "white"),
                                                              "size": ("small", "medium", "large", "50 ft")},
     (8, 70), ("garden", "professional", "outdoor", "durable")),
    ("Baby", "Nursery", ("baby blanket", "crib sheets", "baby monitor", "diaper bag"),
     ("soft", "organic cotton", "machine washable", "hypoallergenic", "large capacity", "night vision",
      "breathable", "waterproof", "for boys and girls"), {"color": ("white", "gray", "pink", "light blue",
                                                                      "beige", "green")}, (12, 110),
     ("cozy", "gentle", "baby", "premium")),
)
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
