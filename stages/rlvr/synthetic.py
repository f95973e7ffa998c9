"""Seeded synthetic RLVR prompt sets (no downloads): small tasks graded by the reward workers that exist already, so a
135M model can score above zero before training and an RLVR run has groups with mixed rewards to learn from.

Each task is a function ``(rng, index) -> row`` (a JSONL line: ``id, domain, tag, prompt, ground_truth``); a set is
``make_rows(task, n, seed, split)`` and is the same for the same arguments on every machine (``random.Random`` seeded
from the split's name, no hash randomisation). Splits ``train`` and ``heldout`` use different seeds and the held-out
rows drop any prompt text that also occurs in the train split.

    python -m stages.rlvr.synthetic --output data/rlvr             # writes <task>_train.jsonl, <task>_heldout.jsonl

Tasks and their reward workers:

* ``add1`` — single-digit addition (``Compute 3 + 5.``), ``math_rule``;
* ``add2`` — two-digit addition without carry, ``math_rule``;
* ``larger2`` / ``larger4`` — which of 2 / 4 two-digit numbers is the largest, letter in ``\\boxed{}``,
  ``multiple_choice_boxed``;
* ``lower`` — describe a thing in all lowercase letters, ``ifeval`` (``validate_lowercase``).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Callable

LETTERS = "ABCD"
THINGS = ("the sea", "a forest", "a city at night", "a cat", "the moon", "a river", "a mountain", "a library",
          "a storm", "a garden", "a train station", "the desert", "a market", "snow", "a bakery", "the sky")
SPLIT_SEEDS = {"train": 1, "heldout": 2}


def _add1(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    return f"Compute {a} + {b}. Put the final answer in \\boxed{{}}.", str(a + b)


def _add2(rng: random.Random) -> tuple[str, str]:
    a1, b1 = rng.randint(1, 4), rng.randint(1, 4)
    a0, b0 = rng.randint(0, 4), rng.randint(0, 5)
    a, b = 10 * a1 + a0, 10 * b1 + b0
    return f"Compute {a} + {b}. Put the final answer in \\boxed{{}}.", str(a + b)


def _larger(options: int) -> Callable[[random.Random], tuple[str, str]]:
    def task(rng: random.Random) -> tuple[str, str]:
        numbers = rng.sample(range(10, 100), options)
        lines = "\n".join(f"{LETTERS[i]}. {n}" for i, n in enumerate(numbers))
        gold = LETTERS[numbers.index(max(numbers))]
        return (f"Which number is the largest?\n{lines}\nAnswer with the letter of the correct option in "
                "\\boxed{}.", gold)
    return task


def _lower(rng: random.Random) -> tuple[str, str]:
    thing = rng.choice(THINGS)
    words = rng.choice((10, 20, 30))
    return (f"Describe {thing} in about {words} words, using only lowercase letters (no capital letters at all).",
            json.dumps([{"func_name": "validate_lowercase"}]))


# task → (generator, domain written into the rows, reward worker that grades it)
TASKS: dict[str, tuple[Callable[[random.Random], tuple[str, str]], str]] = {
    "add1": (_add1, "math_rule"),
    "add2": (_add2, "math_rule"),
    "larger2": (_larger(2), "multiple_choice_boxed"),
    "larger4": (_larger(4), "multiple_choice_boxed"),
    "lower": (_lower, "ifeval"),
}


def make_rows(task: str, n: int, split: str = "heldout", seed: int = 0, exclude: frozenset[str] = frozenset()
              ) -> list[dict]:
    """``n`` rows of ``task`` for ``split`` (distinct prompts, none in ``exclude``). Rows: ``{id, domain, tag,
    prompt, ground_truth}``; ``domain`` is ``<task>_<split>``, the stem of the file :func:`write_task` writes, since a
    config names its prompt files and their reward routes by the same name."""
    if task not in TASKS:
        raise ValueError(f"unknown synthetic task '{task}'; known: {', '.join(TASKS)}")
    make, _ = TASKS[task]
    rng = random.Random(f"{task}/{split}/{SPLIT_SEEDS[split]}/{seed}")
    rows: list[dict] = []
    seen = set(exclude)
    for _ in range(200 * n):
        if len(rows) == n:
            break
        prompt, gold = make(rng)
        if prompt in seen and task != "lower":
            continue
        seen.add(prompt)
        rows.append({"id": f"{task}-{split}-{len(rows):04d}", "domain": f"{task}_{split}", "tag": task,
                     "prompt": prompt, "ground_truth": gold})
    return rows


def write_task(task: str, folder: Path, n_train: int, n_heldout: int, seed: int = 0) -> list[Path]:
    """``<folder>/<task>_train.jsonl`` and ``<task>_heldout.jsonl`` (held-out prompts never in the train file,
    except for ``lower``, whose prompts are few by design)."""
    train = make_rows(task, n_train, "train", seed)
    heldout = make_rows(task, n_heldout, "heldout", seed, frozenset(r["prompt"] for r in train))
    paths = []
    for split, rows in (("train", train), ("heldout", heldout)):
        path = folder / f"{task}_{split}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default=str(Path(__file__).resolve().parents[2] / "data" / "rlvr"))
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--train", type=int, default=400, help="train prompts per task")
    parser.add_argument("--heldout", type=int, default=200, help="held-out prompts per task")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    folder = Path(args.output)
    folder.mkdir(parents=True, exist_ok=True)
    for task in args.tasks:
        for path in write_task(task, folder, args.train, args.heldout, args.seed):
            print(path)


if __name__ == "__main__":
    main()
