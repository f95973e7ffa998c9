"""Steps per second of the GEM games, GEM single-turn envs and WebShop alone, and WebShop's search latency.

Two modes per env: ``live`` steps one env object; ``stateless`` does what the dataflow does per turn — restore the
env from the previous row's state string, step, serialise the new state. Times are this process's CPU time (the
machine is shared; wall time would count other jobs), steps and resets timed apart (``<env>_reset_ms``). Actions are
random texts a model might write for that env (legal moves, some malformed). WebShop's search latency is measured per
distinct query (instruction texts, the LRU cache cleared first) on the default 6000-product catalogue; the index
build (once per catalogue, cached in ``.cache/webshop``) is timed separately.

The share of a rollout's wall time spent in an env is ``env_ms / (env_ms + gen_ms)`` with ``gen_ms`` the generation
time of one turn of one sample (``--gen-ms-per-turn``, default 70 ms: 64 new tokens at ~900 tok/s, vLLM CPU at batch
128 on this machine, STACK.md). The last line is machine-readable:

    RESULT <env>_steps_per_s=... <env>_stateless_steps_per_s=... webshop_search_ms=... webshop_search_p95_ms=...

Usage: ``python benchmarks/env_more.py [--steps N] [--queries Q] [--seed S]``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stages.envs import make_env, restore_env  # noqa: E402
from stages.envs.gem_adapter import gem_installed  # noqa: E402

Texts = Callable[[random.Random], str]


def _boxed(choices: list[str]) -> Texts:
    return lambda rnd: f"Let me think. \\boxed{{{rnd.choice(choices)}}}"


DIGITS = [str(i) for i in range(1, 51)]
GEM_GAMES: dict[str, Texts] = {
    "game:GuessTheNumber-v0-hard": _boxed(DIGITS),
    "game:Hangman-v0-hard": _boxed(list("ETAOINSHRDLUCMFWYP")),
    "game:Mastermind-v0-hard": _boxed([" ".join(random.Random(i).sample("12345678", 4)) for i in range(40)]),
    "game:Minesweeper-v0-hard": _boxed([f"{a} {r} {c}" for a in ("reveal", "reveal", "flag") for r in range(8)
                                        for c in range(8)]),
    "game:Sudoku-v0-easy": _boxed([f"{r} {c} {n}" for r in range(1, 5) for c in range(1, 5) for n in range(1, 5)]),
    "game:TowerofHanoi-v0-hard": _boxed(["A B", "A C", "B C", "B A", "C A", "C B"]),
    "game:Wordle-v0-hard": _boxed(["CRANE", "SLOTH", "PIVOT", "MOUSE", "GRAND", "LIGHT"]),
    "game:Game2048-v0-hard": _boxed(["up", "down", "left", "right"]),
    "game:Sokoban-v0-easy": _boxed(["up", "down", "left", "right"]),
}
GEM_SINGLE: dict[str, Texts] = {
    "gem:math": _boxed(["42", "164", "\\frac{17}{6}", "-8"]),
    "rg:basic_arithmetic": _boxed(["-21", "7", "100"]),
}
WEBSHOP_CLICKS = ["click[next >]", "click[< prev]", "click[back to search]", "click[buy now]", "click[large]",
                  "click[black]", "click[medium]"]


def _texts_with_noise(make: Texts, rnd: random.Random, n: int) -> list[str]:
    return [make(rnd) if rnd.random() > 0.03 else "I am not sure." for _ in range(n)]


def _run(name: str, texts: list[str], seed: int, stateless: bool, chooser=None) -> tuple[float, float]:
    """(steps/s, ms per reset) over ``texts``, CPU time of this process (``chooser(env, text)`` may rewrite a text
    from the page, for WebShop). Step time excludes resets; in stateless mode it includes restore + get_state."""
    env = make_env(name)
    episode = seed
    env.reset(episode)
    state = env.get_state() if stateless else None
    step_s = reset_s = 0.0
    resets = 0
    for text in texts:
        start = time.process_time()
        if stateless:
            env = restore_env(state)
        if chooser is not None:
            text = chooser(env, text)
        _, _, terminated, truncated, _ = env.step(text)
        if stateless and not (terminated or truncated):
            state = env.get_state()
        step_s += time.process_time() - start
        if terminated or truncated:
            episode += 1
            start = time.process_time()
            env.reset(episode)
            if stateless:
                state = env.get_state()
            reset_s += time.process_time() - start
            resets += 1
    return len(texts) / max(step_s, 1e-9), 1000 * reset_s / max(resets, 1)


def _webshop_chooser(rnd: random.Random):
    def choose(env, text: str) -> str:
        if env.page == "search":
            words = env.goal.instruction.split()
            return f"<answer>search[{' '.join(words[: rnd.randint(4, len(words))])}]</answer>"
        if env.page == "results" and env.page_asins() and rnd.random() < 0.6:
            return f"<answer>click[{rnd.choice(env.page_asins()).lower()}]</answer>"
        if env.page == "item" and rnd.random() < 0.5:
            values = [v for vs in env.product().options.values() for v in vs]
            return f"<answer>click[{rnd.choice(values)}]</answer>"
        return f"<answer>{text}</answer>"
    return choose


def webshop_search_latency(queries: int, seed: int) -> tuple[float, float, float]:
    """(build seconds for a fresh 6000-product index in a temp dir, mean ms and p95 ms per uncached query)."""
    import tempfile

    from stages.envs.webshop.search import open_catalogue
    from stages.envs.webshop.tasks import make_goal

    with tempfile.TemporaryDirectory() as tmp:
        start = time.process_time()
        open_catalogue(6000, 0, tmp)
        build_s = time.process_time() - start
    index = open_catalogue(6000, 0)
    texts = [make_goal(index, seed + i).instruction for i in range(queries)]
    index._search.cache_clear()
    times = []
    for text in texts:
        start = time.process_time()
        index.search(text, 50)
        times.append((time.process_time() - start) * 1000)
        index._search.cache_clear()
    return build_s, statistics.mean(times), sorted(times)[int(0.95 * (len(times) - 1))]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=2000, help="env steps per measurement")
    parser.add_argument("--queries", type=int, default=300, help="distinct WebShop search queries")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gen-ms-per-turn", type=float, default=70.0)
    args = parser.parse_args(argv)
    results: dict[str, float] = {}
    rnd = random.Random(args.seed)
    envs = {**GEM_GAMES, **GEM_SINGLE} if gem_installed() else {}
    for name, make in envs.items():
        key = name.split(":")[-1].split("-v0")[0].lower().replace(":", "_")
        key = f"gem_{key}"
        texts = _texts_with_noise(make, rnd, args.steps)
        make_env(name).reset(0)  # build GEM's pristine env outside the timing
        results[f"{key}_steps_per_s"], results[f"{key}_reset_ms"] = _run(name, texts, args.seed, stateless=False)
        results[f"{key}_stateless_steps_per_s"], _ = _run(name, texts, args.seed, stateless=True)
    texts = [rnd.choice(WEBSHOP_CLICKS) for _ in range(args.steps)]
    index = make_env("WebShop").index
    for mode in ("", "_stateless"):
        index._search.cache_clear()  # each run searches cold
        results[f"webshop{mode}_steps_per_s"], results["webshop_reset_ms"] = _run(
            "WebShop", texts, args.seed, mode == "_stateless", _webshop_chooser(random.Random(1)))
    build_s, mean_ms, p95_ms = webshop_search_latency(args.queries, args.seed)
    results.update(webshop_search_ms=mean_ms, webshop_search_p95_ms=p95_ms, webshop_index_build_s=build_s)

    print(f"{'measurement':<44}{'value':>12}{'env share of a turn':>22}")
    for key, value in results.items():
        share = ""
        if key.endswith("steps_per_s"):
            env_ms = 1000.0 / value
            share = f"{100 * env_ms / (env_ms + args.gen_ms_per_turn):.2f} %"
        print(f"{key:<44}{value:>12,.2f}{share:>22}")
    print("RESULT " + " ".join(f"{k}={v:.3f}" if v < 100 else f"{k}={v:.0f}" for k, v in results.items()))


if __name__ == "__main__":
    main()
