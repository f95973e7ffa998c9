"""vLLM's sleep mode on a GPU (issue 45): is memory freed at level 2, and does a wake with a new checkpoint serve it?

For a GPU machine with the CUDA set installed (``make setup-gpu``, which needs a package index). On the default model
(checkpoint A, from its package) and a copy with changed weights (checkpoint B):

1. build the rollflow vLLM engine (stages/generation/vllm_backend.py) on checkpoint A with ``sleep_mode``; greedy
   tokens of a few prompts;
2. sleep at level 2: the device memory freed (``torch.cuda.mem_get_info`` before and after, as the engine reports);
3. wake with checkpoint B (weights reloaded in place and checked against B's files), greedy tokens again;
4. close it; a fresh engine on checkpoint B; its greedy tokens must equal step 3's, and differ from step 1's.

    .venv-gpu/bin/python benchmarks/gpu_vllm_smoke.py

Last line: ``RESULT released_gib=... weights_checked=N woken_equals_fresh=yes|no changed=yes|no``.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def save_checkpoints(root: Path) -> tuple[Path, Path]:
    """Checkpoint A (the default model, SmolLM2-135M-Instruct, converted once from its package) and B (A with every
    matrix scaled by 1.5, the same tokenizer files)."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    from stages.generation.model_store import default_model_dir

    a = default_model_dir()
    model = AutoModelForCausalLM.from_pretrained(a, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(1.5)
    model.save_pretrained(root / "b")
    for f in a.iterdir():
        if f.is_file() and not (root / "b" / f.name).exists() and f.suffix != ".safetensors":
            shutil.copy(f, root / "b" / f.name)
    return a, root / "b"


def greedy(engine, prompts: list[list[int]]) -> list[list[int]]:
    from stages.generation.engines import GenRequest, SamplingSpec

    spec = SamplingSpec(temperature=0.0, max_new_tokens=24)
    return [r.response_token_ids for r in engine.generate([GenRequest(p, spec) for p in prompts])]


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device (torch.cuda.is_available() is False): this check needs a GPU and the CUDA vLLM")
        print("RESULT skipped=no_cuda")
        return 1
    from stages.generation.vllm_backend import VLLMEngine

    root = Path(tempfile.mkdtemp(prefix="rollflow-vllm-smoke-"))
    a, b = save_checkpoints(root)
    prompts = [[1 + (7 * i + j) % 4000 for j in range(16)] for i in range(4)]
    options = dict(dtype="bfloat16", max_model_len=512, gpu_memory_utilization=0.3, sleep_mode=True)
    engine = VLLMEngine(str(a), **options)
    tokens_a = greedy(engine, prompts)
    slept = engine.sleep(2)
    released = slept["released_bytes"] / 2**30
    print(f"sleep level 2: {released:.2f} GiB of device memory freed")
    engine.wake(str(b))  # raises if the weights it serves are not B's (stages/generation/weight_check.py)
    checked = engine.check_weights(str(b))
    print(f"wake with checkpoint B: {checked} sampled tensors equal B's files")
    woken = greedy(engine, prompts)
    engine.close()
    fresh_engine = VLLMEngine(str(b), **options)
    fresh = greedy(fresh_engine, prompts)
    fresh_engine.close()
    same, changed = woken == fresh, woken != tokens_a
    print(f"wake with checkpoint B: tokens equal a fresh engine on B: {same}; differ from checkpoint A's: {changed}")
    print(f"RESULT released_gib={released:.2f} weights_checked={checked} woken_equals_fresh={'yes' if same else 'no'} "
          f"changed={'yes' if changed else 'no'}")
    return 0 if same and changed and released > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
