"""GEM ("A Gym for Generalist LLMs", PyPI ``gem-llm``) environments behind rollflow's text-env contract.

:class:`GemEnv` wraps one environment of GEM's own registry (``gem.envs.registration.ENV_REGISTRY``) by its GEM id:
the procedurally generated games (``game:GuessTheNumber-v0-easy``, ``game:Hangman-v0-hard``, ``game:Sudoku-v0-easy``,
``game:Game2048-v0-easy``, ``game:Sokoban-v0-easy``, ...), the reasoning-gym tasks (``rg:<task>``) and GEM's math,
QA and code environments, which GEM loads from a hub at run time and rollflow feeds from a local file instead
(``data_path``; small sets ship in ``data/gem/``). Nothing is ever downloaded: GEM's ``nltk.download("words")`` is
replaced by a local word list (``data/gem/nltk_data``) and ``datasets.load_dataset`` is never called.

Text and rewards are GEM's: the observation is GEM's observation followed by GEM's ``info["suffix"]`` (the board),
joined the way GEM's own ``concat`` observation wrapper joins them; reward, ``terminated`` and ``truncated`` are what
GEM returns. Two deliberate differences: a response GEM cannot parse gets ``format_penalty`` as its reward (its default
is GEM's own value for that environment, so by default nothing changes), and a step after the episode ended is a
no-op (GEM would keep playing). ``env_instruction`` holds the answer-format hint GEM's prompt templates add.

Determinism and stateless stepping: GEM draws from the global ``random`` / ``np.random``; during every GEM call here
GEM's own names for those point at the episode's private generators (one call at a time, under a lock), so an episode
depends on its seed and actions only, never on what else ran or runs in the process (another thread's draws included). ``get_state()`` is ``{seed, actions}``; ``restore`` rebuilds GEM's env
and replays the actions (a process-local snapshot cache skips the replay when the state was produced here). A game's
stored action is the list of its ``\\boxed{...}`` candidates, which GEM's parsers read identically (see
:func:`boxed_candidates`). Each episode starts from a copy of a pristine GEM env built once per configuration.

Installed with ``pip install --no-deps gem-llm==0.1.0`` plus ``reasoning-gym==0.1.23 nltk==3.9.1 datasets==5.2.0``
(gem-llm 0.1.0 pins ``msgspec==0.19.0``, which only its search tool imports; the stack keeps vLLM's msgspec).
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import json
import logging
import random
import re
import sys
import threading
from collections import OrderedDict
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, NamedTuple

import numpy as np

from schemas.errors import ConfigError
from stages.envs.base import (STATE_VERSION, EnvStateError, TextEnv, check_seed, dumps_compact, fresh_seed, jsonable,
                              step_info)
from stages.envs.records import read_records
from stages.envs.registry import ENVIRONMENTS, EnvSpec, register_env

REPO_ROOT = Path(__file__).resolve().parents[2]
GEM_DATA_DIR = REPO_ROOT / "data" / "gem"
NLTK_DATA_DIR = GEM_DATA_DIR / "nltk_data"
INSTALL_HINT = ("pip install --no-deps gem-llm==0.1.0 && pip install reasoning-gym==0.1.23 nltk==3.9.1 "
                "datasets==5.2.0")

# Answer-format hints (GEM keeps them in its prompt templates, not in the envs).
BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
QA_INSTRUCTION = "Think step by step, then give your final answer inside <answer> </answer> tags."
CODE_INSTRUCTION = ("Write a Python 3 program that reads standard input and writes standard output, in one "
                    "```python code block.")

# GEM env attributes that are never mutated in place (reassigned at most) and may be large or uncopyable: episode
# copies share them with the pristine env instead of deep-copying them.
_SHARED_ATTRS = frozenset({"all_words", "available_words", "word_list", "word_data", "dataset", "dataset_iter", "ds",
                           "ds_iter", "reward_fn", "mp_pool", "thread_pool_executer"})
_BOXED_CANDIDATE = re.compile(r"\\(?i:boxed)\{[^{}\\]*\}")
_GEM_LOCK = threading.RLock()  # GEM's module-level generator names are swapped per call: one GEM call at a time
_SNAPSHOTS_MAX = 512


class Family(NamedTuple):
    """What kind of GEM env an entry point is: how to read validity, success and the answer from a response."""

    name: str  # game | math | qa | code | rg
    multi_turn: bool
    instruction: str


_FAMILIES = {
    "gem.envs.game_env": Family("game", True, BOXED_INSTRUCTION),
    "gem.envs.math_env": Family("math", False, BOXED_INSTRUCTION),
    "gem.envs.qa_env": Family("qa", False, QA_INSTRUCTION),
    "gem.envs.code_env": Family("code", False, CODE_INSTRUCTION),
    "gem.envs.reasoning_gym": Family("rg", False, BOXED_INSTRUCTION),
}


# ---- GEM import, without its side effects ----------------------------------------------------------------------------
@lru_cache(maxsize=1)
def gem_registry() -> Mapping[str, Any]:
    """GEM's ``ENV_REGISTRY`` (id → spec with ``entry_point`` and ``kwargs``). Imports GEM once.

    ``import gem`` calls ``logging.basicConfig(level=INFO)``; the root logger is put back as it was.
    """
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        from gem.envs.registration import ENV_REGISTRY
    except ImportError as exc:
        raise ConfigError(f"GEM environments need the gem-llm package ({exc}); install it with: {INSTALL_HINT}") \
            from None
    finally:
        for handler in list(root.handlers):
            if handler not in handlers:
                root.removeHandler(handler)
        root.setLevel(level)
    _use_local_nltk_data()
    return ENV_REGISTRY


def _use_local_nltk_data() -> None:
    import nltk

    if str(NLTK_DATA_DIR) not in nltk.data.path:
        nltk.data.path.insert(0, str(NLTK_DATA_DIR))


@contextmanager
def _no_downloads() -> Iterator[None]:
    """Within: ``nltk.download(name)`` checks the corpus is local instead of fetching it (raises if it is not)."""
    import nltk

    def local_only(info_or_id: Any = None, *args: Any, **kwargs: Any) -> bool:
        try:
            nltk.data.find(f"corpora/{info_or_id}")
        except LookupError:
            raise ConfigError(f"GEM asked NLTK to download '{info_or_id}', which rollflow never downloads; put the "
                              f"corpus under {NLTK_DATA_DIR}/corpora/") from None
        return True

    original = nltk.download
    nltk.download = local_only
    try:
        yield
    finally:
        nltk.download = original


def gem_ids(prefix: str = "") -> list[str]:
    """GEM's registered env ids starting with ``prefix`` (e.g. ``"game:"``, ``"rg:"``), sorted."""
    return sorted(i for i in gem_registry() if i.startswith(prefix))


def _family(env_id: str, entry_point: Any) -> Family:
    module = entry_point.split(":")[0] if isinstance(entry_point, str) else getattr(entry_point, "__module__", "")
    for prefix, family in _FAMILIES.items():
        if module == prefix or module.startswith(prefix + "."):
            return family
    raise ConfigError(f"GEM env '{env_id}' ({module}) is not supported by rollflow's adapter (it needs a tool "
                      "server, images or docker); supported: game:*, rg:*, math/qa/code envs with a local data_path")


def _resolve_class(env_id: str) -> tuple[type, dict, Family]:
    registry = gem_registry()
    spec = registry.get(env_id)
    if spec is None:
        near = [i for i in registry if env_id.split(":")[-1].lower() in i.lower()][:8]
        raise ConfigError(f"GEM has no environment '{env_id}'; similar ids: {', '.join(near) or '(none)'}; list them "
                          "with stages.envs.gem_adapter.gem_ids()")
    family = _family(env_id, spec.entry_point)
    if isinstance(spec.entry_point, str):
        module_name, class_name = spec.entry_point.split(":")
        cls = getattr(importlib.import_module(module_name), class_name)
    else:
        cls = spec.entry_point
    return cls, dict(spec.kwargs), family


# ---- the episode's own generators, in place of the process-global ones ---------------------------------------------
RngState = tuple  # (random.Random().getstate(), np.random.RandomState().get_state())


class _RandomView:
    """The ``random`` module as GEM's modules see it during a call: its module functions (``seed``, ``choice``,
    ``shuffle``, ...) are those of a private ``random.Random``; everything else (``Random``, ...) is the module's."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._rng, name, None)
        return method if callable(method) and not name.startswith("_") and not isinstance(method, type) \
            else getattr(random, name)


class _NumpyRandomView:
    """``np.random`` as GEM's modules see it during a call: the legacy module functions (``seed``, ``choice``,
    ``randint``, ...) are those of a private ``RandomState``; everything else (``default_rng``, ``Generator``, ...) is
    numpy's own."""

    def __init__(self, state: np.random.RandomState) -> None:
        self._state = state

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._state, name, None)
        return method if callable(method) and not name.startswith("_") and not isinstance(method, type) \
            else getattr(np.random, name)


class _NumpyView:
    """``numpy`` as GEM's modules see it during a call: numpy itself, but with :class:`_NumpyRandomView` as ``random``."""

    def __init__(self, state: np.random.RandomState) -> None:
        self.random = _NumpyRandomView(state)

    def __getattr__(self, name: str) -> Any:
        return getattr(np, name)


# the last scan of _global_rng_names: (the loaded modules' key it was made at, its sites); ((0, ""), []) before it
_RNG_SITES: tuple[tuple[int, str], list[tuple[Any, str, Any]]] = ((0, ""), [])


def _loaded_modules_key() -> tuple[int, str]:
    """What changes when a module is imported (it is added to the end of ``sys.modules``): their number and the last
    one's name."""
    return len(sys.modules), next(reversed(sys.modules))


def _global_rng_names() -> list[tuple[Any, str, Any]]:
    """``(module, name, value)`` for every name in GEM's loaded modules that refers to a process-global generator:
    the ``random`` and ``numpy`` modules and functions bound to ``random``'s hidden instance (``from random import
    shuffle``). Every GEM call needs them and a scan of ``sys.modules`` costs more than a GEM step, so the scan is kept
    until another module is loaded (GEM imports an environment's module when one is first made); called under
    ``_GEM_LOCK``, outside the swap."""
    global _RNG_SITES
    key = _loaded_modules_key()
    if _RNG_SITES[0] != key:
        _RNG_SITES = (key, _scan_global_rng_names())
    return _RNG_SITES[1]


def _scan_global_rng_names() -> list[tuple[Any, str, Any]]:
    """:func:`_global_rng_names` scanned from ``sys.modules``."""
    sites = []
    for module_name, module in list(sys.modules.items()):
        if module is None or not (module_name == "gem" or module_name.startswith("gem.")):
            continue
        for name, value in list(vars(module).items()):
            if value is random or value is np or getattr(value, "__self__", None) is random._inst:
                sites.append((module, name, value))
    return sites


@contextmanager
def _private_generators(py: random.Random, npr: np.random.RandomState) -> Iterator[None]:
    """GEM's module-level names for the global generators point at ``py``/``npr`` for the duration (call it under
    ``_GEM_LOCK``). Swapping names rather than the globals' state keeps other threads' draws (Prefect's, Ray's, the
    caller's) out of an episode, and the episode's draws out of theirs."""
    sites = _global_rng_names()
    random_view, numpy_view = _RandomView(py), _NumpyView(npr)
    for module, name, value in sites:
        setattr(module, name,
                random_view if value is random else numpy_view if value is np else getattr(py, value.__name__))
    try:
        yield
    finally:
        for module, name, value in sites:
            setattr(module, name, value)


def run_isolated(fn: Callable[[], Any], rng: RngState | None) -> tuple[Any, RngState]:
    """Run ``fn`` (a GEM call) with GEM drawing from its own generators, started from ``rng`` (fresh ones if
    ``None``: GEM's ``reset(seed)`` seeds them); return its result and the generators' state afterwards. The
    process-global ``random``/``np.random`` are neither read nor advanced, whatever other threads do meanwhile."""
    py, npr = random.Random(), np.random.RandomState()
    if rng is not None:
        py.setstate(rng[0])
        npr.set_state(rng[1])
    with _GEM_LOCK, _private_generators(py, npr):
        result = fn()
    return result, (py.getstate(), npr.get_state())


_CONSTRUCTION_RNG: RngState = (random.Random(0).getstate(), np.random.RandomState(0).get_state())


def clone_gem_env(env: Any) -> Any:
    """An independent copy of a GEM env: episode attributes deep-copied, :data:`_SHARED_ATTRS` shared."""
    clone = object.__new__(type(env))
    clone.__dict__.update({k: (v if k in _SHARED_ATTRS else copy.deepcopy(v)) for k, v in env.__dict__.items()})
    return clone


# ---- local data for GEM's dataset envs -------------------------------------------------------------------------------
def resolve_data_path(data_path: str) -> Path:
    """``data_path`` as given if it exists, else relative to the repository root; ConfigError if neither exists."""
    path = Path(data_path)
    for candidate in (path, REPO_ROOT / path):
        if candidate.is_file():
            return candidate.resolve()
    raise ConfigError(f"GEM data_path '{data_path}' does not exist (also looked under {REPO_ROOT}); point it at a "
                      "local .jsonl/.json/.parquet file — rollflow never downloads data sets")


@lru_cache(maxsize=16)
def _local_dataset(path: str, mtime_ns: int) -> Any:
    """A ``datasets.Dataset`` over the local file (built in memory; cached per file version)."""
    try:
        import datasets
        from datasets import Dataset
    except ImportError as exc:
        raise ConfigError(f"GEM's math/QA/code envs need the datasets package ({exc}); install it with: "
                          f"{INSTALL_HINT}") from None
    datasets.disable_progress_bars()  # QaEnv's dataset.map would print one per env
    rows = read_records(Path(path))
    if not rows:
        raise ConfigError(f"{path} holds no records; give at least one")
    return Dataset.from_list(rows)


# ---- pristine GEM envs, one per configuration -----------------------------------------------------------------------
_PRISTINE: dict[str, Any] = {}


def pristine_gem_env(env_id: str, env_kwargs: Mapping[str, Any], data_path: str | None) -> Any:
    """The GEM env built once per (id, kwargs, data file) in this process; never stepped, only cloned."""
    cls, kwargs, family = _resolve_class(env_id)
    kwargs.update(env_kwargs)
    data_key = None
    if family.name in ("math", "qa", "code"):
        if data_path is None:
            hub = kwargs.get("dataset_name", "")
            raise ConfigError(f"GEM env '{env_id}' loads '{hub}' from a hub at run time; rollflow does not download: "
                              f"give data_path=<local .jsonl> with the fields {kwargs.get('question_key')!r} and "
                              f"{kwargs.get('answer_key', kwargs.get('test_key'))!r} (small sets: {GEM_DATA_DIR})")
        path = resolve_data_path(data_path)
        data_key = (str(path), path.stat().st_mtime_ns)
        kwargs["dataset"] = _local_dataset(*data_key)
        kwargs.pop("split", None)
        if family.name == "math":
            kwargs["use_mp"] = False  # one grading process per env is GEM's option for distributed runs
        if family.name == "code" and not any(k in str(kwargs.get("dataset_name", "")).lower()
                                             for k in ("taco", "apps", "codecontest", "primeintellect")):
            kwargs["dataset_name"] = "local-codecontests"  # GEM grades only these test layouts (inputs/outputs)
    key = dumps_compact([env_id, jsonable({k: v for k, v in kwargs.items() if k != "dataset"}), data_key])
    with _GEM_LOCK:
        env = _PRISTINE.get(key)
        if env is None:
            def build() -> Any:
                with _no_downloads():
                    return cls(**kwargs)

            try:
                env, _ = run_isolated(build, _CONSTRUCTION_RNG)
            except TypeError as exc:
                raise ConfigError(f"GEM env '{env_id}': bad env_kwargs ({exc}); see {cls.__module__}.{cls.__name__}") \
                    from None
            except (ValueError, KeyError, AssertionError) as exc:
                raise ConfigError(f"GEM env '{env_id}' fails in GEM's own constructor ({exc!r}); pick another "
                                  "variant or set its env_kwargs") from None
            _PRISTINE[key] = env
    return env


# ---- response → what GEM reads -------------------------------------------------------------------------------------
def boxed_candidates(text: str) -> str:
    """Every ``\\boxed{...}`` (``boxed`` in any case) whose inside holds no ``{``, ``}`` or backslash, one a line.

    Every GEM game parses a response with ``re.finditer(r"\\\\boxed{<inner>}")`` (last match wins), where ``<inner>``
    only admits letters, digits, spaces and commas. Such a match starts at a ``\\boxed{``, ends at the first ``}``
    and contains no backslash, so it is one of these candidates, and the candidates do not overlap: GEM's parser finds
    the same matches, in the same order, in the joined candidates as in the full text. The stored action history is
    therefore short and replays exactly.
    """
    return "\n".join(m.group(0) for m in _BOXED_CANDIDATE.finditer(text))


def _as_text(action_text: Any) -> str:
    if isinstance(action_text, str):
        return action_text
    return "" if action_text is None else str(action_text)


def join_observation(observation: Any, info: Mapping[str, Any]) -> str:
    """GEM's ``concat`` wrapper text for one turn: the observation, a newline if needed, then ``info["suffix"]``."""
    text = "" if observation is None else str(observation)
    suffix = info.get("suffix") if isinstance(info, Mapping) else None
    if suffix:
        if text and not text.endswith("\n"):
            text += "\n"
        text += str(suffix)
    return text


# ---- snapshots for stateless stepping ------------------------------------------------------------------------------
_SNAPSHOTS: "OrderedDict[str, tuple]" = OrderedDict()


def _snapshot_put(key: str, value: tuple) -> None:
    with _GEM_LOCK:
        _SNAPSHOTS[key] = value
        _SNAPSHOTS.move_to_end(key)
        while len(_SNAPSHOTS) > _SNAPSHOTS_MAX:
            _SNAPSHOTS.popitem(last=False)


def _snapshot_get(key: str) -> tuple | None:
    with _GEM_LOCK:
        value = _SNAPSHOTS.get(key)
        if value is not None:
            _SNAPSHOTS.move_to_end(key)
        return value


def clear_snapshots() -> None:
    """Drop the snapshot cache (tests use it to force the replay path)."""
    with _GEM_LOCK:
        _SNAPSHOTS.clear()


# ---- the environment -----------------------------------------------------------------------------------------------
class GemEnv(TextEnv):
    """One GEM environment (``env_id`` = its GEM id) behind the rollflow contract; see the module docstring.

    ``env_kwargs`` override GEM's registered constructor kwargs; ``max_steps`` (if given) is passed as GEM's
    ``max_turns``; after ``reset`` ``self.max_steps`` is the episode's real turn limit (``-random`` variants draw it).
    ``data_path`` (math/QA/code) is a local file with GEM's fields (``problem``/``answer``, ``question``/``answer``,
    ``problem``/``tests``). ``format_penalty=None`` means GEM's own reward for an unparseable response.
    """

    def __init__(self, env_id: str = "game:GuessTheNumber-v0-easy", env_kwargs: Mapping[str, Any] | None = None,
                 data_path: str | None = None, max_steps: int | None = None, format_penalty: float | None = None,
                 env_instruction: str | None = None, use_snapshots: bool = True) -> None:
        cls, registered, family = _resolve_class(str(env_id))
        self.env_id, self.family = str(env_id), family
        self.env_kwargs = dict(env_kwargs or {})
        if max_steps is not None:
            if int(max_steps) < 1:
                raise ConfigError(f"GemEnv({env_id}): max_steps must be >= 1, got {max_steps}")
            if family.multi_turn:
                self.env_kwargs["max_turns"] = int(max_steps)
        self.data_path = data_path
        if family.name in ("math", "qa", "code"):
            pristine_gem_env(self.env_id, self.env_kwargs, data_path)  # fail early on a missing local file
        elif data_path is not None:
            raise ConfigError(f"GemEnv({env_id}): data_path is only for GEM's math/qa/code envs; drop it")
        turns = self.env_kwargs.get("max_turns", registered.get("max_turns"))
        self.max_steps = int(turns) if family.multi_turn and turns else (100 if family.multi_turn else 1)
        self.format_penalty = float(self._gem_format_reward() if format_penalty is None else format_penalty)
        self.env_instruction = env_instruction if env_instruction is not None else family.instruction
        self.use_snapshots = bool(use_snapshots)
        self._set_config({"env_id": self.env_id, "env_kwargs": env_kwargs, "data_path": data_path,
                          "max_steps": max_steps, "format_penalty": format_penalty,
                          "env_instruction": env_instruction, "use_snapshots": self.use_snapshots})
        self._clear_episode()

    def _gem_format_reward(self) -> float:
        """GEM's reward for an unparseable response: LanguageGameReward.format_error_reward for games, -0.1 for
        code (CodeEnv.step), 0 for math/QA/reasoning-gym (graded wrong)."""
        if self.family.name == "game":
            from gem.utils.constants import LanguageGameReward

            return LanguageGameReward.format_error_reward
        return -0.1 if self.family.name == "code" else 0.0

    def _clear_episode(self) -> None:
        self._gem: Any = None
        self._rng: RngState | None = None
        self.seed: int | None = None
        self.actions: list[str] = []
        self.step_count = 0
        self.done = False
        self.truncated = False
        self._obs = ""

    # ---- episode -------------------------------------------------------------------------------------------------
    def reset(self, seed: int | None = None) -> tuple[str, dict]:
        seed = check_seed(seed, f"GemEnv({self.env_id}).reset", upper=2**32)  # np.random.seed's range
        seed = fresh_seed() if seed is None else seed
        self._clear_episode()
        self._start(seed)
        return self._obs, {"env_instruction": self.get_instructions()}

    def _start(self, seed: int) -> None:
        """Fresh copy of the pristine GEM env, ``reset(seed)`` with the episode's own RNG."""
        gem = clone_gem_env(pristine_gem_env(self.env_id, self.env_kwargs, self.data_path))
        (obs, info), self._rng = run_isolated(lambda: gem.reset(seed=seed), None)
        self._gem, self.seed = gem, seed
        self._obs = join_observation(obs, info)
        if self.family.multi_turn:
            self.max_steps = int(getattr(gem, "max_turns", None) or self.max_steps)

    def step(self, action_text: str) -> tuple[str, float, bool, bool, dict]:
        if self.seed is None:
            raise EnvStateError(f"GemEnv({self.env_id}).step() called before reset(seed); reset the env first")
        text = _as_text(action_text)
        self.step_count += 1
        answer = self._extract(text)
        valid = answer is not None or self.family.name == "game"
        parsed = {"action": answer, "action_content": answer or "", "think_content": ""}
        if self.done:
            info = step_info(parsed, valid=False, effective=False, success=False, format_penalty=self.format_penalty,
                             action_desc=f"At turn {self.step_count}, the episode was already over.")
            return self._obs, 0.0, True, self.truncated, info
        obs, gem_reward, terminated, truncated, gem_info = self._gem_step(text)
        gem_reward = float(gem_reward)
        if self.family.name == "game":  # GEM's format-error branch is the only one returning this reward
            valid = not (terminated and gem_reward == self._gem_format_reward())
            parsed["action"] = answer if valid else None
        reward = gem_reward if valid else self.format_penalty
        success = valid and self._success(obs, gem_reward, bool(terminated), bool(truncated))
        if self.family.multi_turn:
            self.actions.append(boxed_candidates(text))
        self._obs = join_observation(obs, gem_info)
        self.done, self.truncated = bool(terminated or truncated), bool(truncated)
        if self.done:
            self._gem, self._rng = None, None
        desc = (f"At turn {self.step_count}, you answered {answer}." if valid
                else f"At turn {self.step_count}, GEM could not parse a valid action from the response.")
        info = step_info(parsed, valid=valid, effective=valid, success=success,
                         format_penalty=0.0 if valid else self.format_penalty, action_desc=desc)
        info["gem_reward"] = gem_reward
        info["gem_info"] = jsonable({k: v for k, v in (gem_info or {}).items()
                                     if isinstance(v, (str, int, float, bool, type(None), list, tuple, dict))})
        return self._obs, float(reward), bool(terminated), bool(truncated), info

    def _gem_step(self, text: str) -> tuple:
        gem = self._gem
        if self.family.name == "qa" and answer_extractor(gem)(text) is None:
            # GEM 0.1.0 QaEnv.step raises UnboundLocalError here; its intended result is reward 0 and the end
            from gem.utils.constants import TERMINAL_STATE

            return TERMINAL_STATE, 0.0, True, True, {"correct": False}
        if self.family.name == "math" and threading.current_thread() is not threading.main_thread():
            return _math_step_in_thread(gem, text)
        result, self._rng = run_isolated(lambda: gem.step(text), self._rng)
        return result

    def _extract(self, text: str) -> str | None:
        """The answer GEM would read from ``text`` (``None`` if it reads none)."""
        from gem.utils import parsing

        name = self.family.name
        if name == "qa":
            return answer_extractor(self._gem)(text) if self._gem is not None else parsing.extract_last_tagged_answer(
                text)
        if name == "code":
            return parsing.extract_code_from_model(text)
        if name == "math":
            from gem.utils.math_grader import extract_answer

            try:
                return extract_answer(text)
            except Exception:  # noqa: BLE001 — GEM's extractor on malformed LaTeX
                return None
        if name == "game":
            last = boxed_candidates(text).rsplit("\n", 1)[-1]
            return last[len("\\boxed{"):-1] if last else None
        return parsing.extract_last_boxed_answer(text)

    def _success(self, obs: Any, reward: float, terminated: bool, truncated: bool) -> bool:
        """Games: GEM ended the episode with its win message (every GEM game starts it with 'Congratulations');
        single-turn envs: full reward."""
        if self.family.name == "game":
            return terminated and not truncated and str(obs).startswith("Congratulations")
        return reward >= 1.0

    # ---- text ----------------------------------------------------------------------------------------------------
    def render(self) -> str:
        if self.seed is None:
            raise EnvStateError(f"GemEnv({self.env_id}).render() called before reset(seed); reset the env first")
        return self._obs

    def get_instructions(self) -> str:
        return self.env_instruction

    @property
    def gem_env(self) -> Any:
        """The live GEM env of this episode (``None`` once it ended). Read-only use: oracles and tests."""
        return self._gem

    # ---- state ---------------------------------------------------------------------------------------------------
    def _started(self) -> bool:
        return self.seed is not None

    def _dynamic_state(self) -> dict:
        state: dict = {"seed": self.seed, "steps": self.step_count, "max_steps": self.max_steps}
        if self.done:
            state.update(done=True, obs=self._obs, truncated=self.truncated)
        else:
            state["actions"] = list(self.actions)
        return state

    def _state_string(self, dynamic: Mapping[str, Any]) -> str:
        """What :meth:`get_state` returns for this config and ``dynamic`` (the snapshot cache key)."""
        return ('{"config":' + self._config_json + ',"env":' + json.dumps(type(self).__name__) + ',"state":'
                + dumps_compact(dynamic) + ',"v":' + str(STATE_VERSION) + "}")

    def get_state(self) -> str:
        state = super().get_state()
        if self.use_snapshots and not self.done and self.family.multi_turn and self._gem is not None:
            _snapshot_put(state, (clone_gem_env(self._gem), self._rng, self._obs))
        return state

    def _load_dynamic_state(self, state: Mapping[str, Any]) -> None:
        try:
            seed, steps, max_steps = int(state["seed"]), int(state["steps"]), int(state["max_steps"])
            done = bool(state.get("done", False))
            actions = [str(a) for a in state.get("actions", [])]
            obs, truncated = str(state.get("obs", "")), bool(state.get("truncated", False))
        except (KeyError, TypeError, ValueError) as exc:
            raise EnvStateError(f"GemEnv state is malformed ({exc!r}); pass the string get_state() returned") from None
        self._clear_episode()
        self.seed, self.step_count, self.max_steps = seed, steps, max_steps
        if done:
            self.done, self.truncated, self._obs = True, truncated, obs
            return
        key = self._state_string({"actions": actions, "max_steps": max_steps, "seed": seed, "steps": steps})
        cached = _snapshot_get(key) if self.use_snapshots else None
        if cached is not None:
            gem, rng, obs = cached
            self._gem, self._rng, self._obs = clone_gem_env(gem), rng, obs
            self.actions = actions
            return
        self._start(seed)
        for text in actions:
            obs, _, terminated, truncated, info = self._gem_step(text)
            self._obs = join_observation(obs, info)
            if terminated or truncated:
                raise EnvStateError(f"GemEnv({self.env_id}) state replays to an ended episode; the state was not "
                                    "produced by this GEM version or configuration")
        self.actions = actions
        self.max_steps = max_steps


def answer_extractor(gem: Any) -> Callable[[str], str | None]:
    """The extractor a GEM ``QaEnv`` applies (boxed or ``<answer>`` tag)."""
    from gem.utils import parsing

    return getattr(gem, "extractor", parsing.extract_last_tagged_answer)


def _math_step_in_thread(gem: Any, text: str) -> tuple:
    """GEM MathEnv's ``_local_step`` off the main thread (where ``signal.alarm`` is unavailable): same grading and
    1 s limit, with a worker thread as the timer."""
    from gem.utils.constants import TERMINAL_STATE

    result: list = []
    worker = threading.Thread(target=lambda: result.append(type(gem).check_correct(text, gem.answer)), daemon=True)
    worker.start()
    worker.join(timeout=1.0)
    correct = bool(result and result[0])
    return TERMINAL_STATE, 1.0 if correct else 0.0, True, True, {"correct": correct}


# ---- registration in rollflow's environment registry ---------------------------------------------------------------
# GEM 0.1.0's game ids that rollflow registers under their GEM id. Left out: Sokoban-v0-hard/-random (GEM generates
# their levels in seconds to tens of seconds per reset), Sudoku-v0-hard (about 0.1 s per reset, too slow for the
# registry-wide contract test), Crosswords-v0-random and FifteenPuzzle-v0-random (GEM's own constructors fail).
# All remain reachable through the generic tag "gem" (env_id=...).
GAME_IDS = tuple(f"game:{name}" for name in (
    "GuessTheNumber-v0-easy", "GuessTheNumber-v0-hard", "GuessTheNumber-v0-random",
    "Hangman-v0-easy", "Hangman-v0-hard", "Hangman-v0-random",
    "Mastermind-v0-easy", "Mastermind-v0-hard", "Mastermind-v0-random",
    "Minesweeper-v0-easy", "Minesweeper-v0-hard", "Minesweeper-v0-random",
    "Sudoku-v0-easy", "Sudoku-v0-random",
    "TowerofHanoi-v0-easy", "TowerofHanoi-v0-hard", "TowerofHanoi-v0-random",
    "Wordle-v0-easy", "Wordle-v0-hard", "Wordle-v0-random",
    "Game2048-v0-easy", "Game2048-v0-hard", "Game2048-v0-extreme-hard", "Game2048-v0-random",
    "Sokoban-v0-easy", "FifteenPuzzle-v0-easy", "FifteenPuzzle-v0-hard",
    "Crosswords-v0-easy", "Crosswords-v0-hard", "WordSearch-v0-easy", "WordSearch-v0-hard", "WordSearch-v0-random"))
# Games whose start does not depend on the seed (the disks always start on tower A).
SEED_INDEPENDENT_START = frozenset({"game:TowerofHanoi-v0-easy", "game:TowerofHanoi-v0-hard"})
# A sample of reasoning-gym tasks registered by id (fast to generate); every other "rg:<task>" of GEM works through
# the generic tag "gem" (env_id="rg:<task>").
RG_IDS = tuple(f"rg:{name}" for name in (
    "basic_arithmetic", "chain_sum", "leg_counting", "letter_counting", "spell_backward", "word_sorting",
    "base_conversion", "gcd", "propositional_logic", "simple_equations", "maze", "mini_sudoku"))
LOCAL_DATA = {"gem:math": ("math:GSM8K", "data/gem/math.jsonl"), "gem:qa": ("qa:NaturalQuestions", "data/gem/qa.jsonl"),
              "gem:code": ("code:CodeContest", "data/gem/code.jsonl")}


def gem_installed() -> bool:
    """Whether the gem-llm package can be imported (checked without importing it)."""
    return importlib.util.find_spec("gem") is not None


def register_gem_envs() -> list[str]:
    """Register the GEM environments in rollflow's registry (nothing if gem-llm is not installed); returns the tags.
    Runs at import of this module; calling it again registers nothing new."""
    if not gem_installed():
        return []

    def add(tag: str, spec: EnvSpec) -> None:
        if tag not in ENVIRONMENTS:
            register_env(tag, spec)

    tags = []
    for gid in GAME_IDS:
        add(gid, EnvSpec(GemEnv, {"env_id": gid}, stochastic="2048" in gid or "Minesweeper" in gid,
                         seeded_start=gid not in SEED_INDEPENDENT_START,
                         description=f"GEM game {gid} (gem-llm 0.1.0), actions in \\boxed{{}}"))
        tags.append(gid)
    for rid in RG_IDS:
        add(rid, EnvSpec(GemEnv, {"env_id": rid}, multi_turn=False,
                         description=f"reasoning-gym task {rid[3:]} through GEM, answer in \\boxed{{}}"))
        tags.append(rid)
    for tag, (gid, path) in LOCAL_DATA.items():
        add(tag, EnvSpec(GemEnv, {"env_id": gid, "data_path": path}, multi_turn=False, needs_data=True,
                         demo_kwargs={"data_path": path},
                         description=f"GEM {gid.split(':')[0]} env ({gid}'s layout) on a local file, default {path}"))
        tags.append(tag)
    add("gem", EnvSpec(GemEnv, {"env_id": "game:GuessTheNumber-v0-easy"},
                       description="any GEM env by id: env_config {env_id: 'game:Sudoku-v0-hard'} or 'rg:<task>'"))
    tags.append("gem")
    return tags


register_gem_envs()
