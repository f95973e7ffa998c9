"""Packed against padded micro-batches in the log-prob pass and the training step (issue 16, packed sequences), side
by side in one run.

Both passes run ``stages.train.forward.forward_rows`` over the same rows with the same token budget: padded, the rows
of a micro-batch are right-padded to its longest row (the budget counts padded tokens); packed
(``use_sequence_packing``), they run as one row without padding, positions restarting per row (the budget counts
real tokens). The rows are FrozenLake-shaped step samples from ``stages.example`` (or ``--samples DIR``, e.g. a run's
``iter_0000/logprobs``). Each pass runs ``--repeats`` times after a warm-up; the best time counts.

The training half (unless ``--no-train``) runs one training step of the real training core (``stages.train.core``:
a DeepSpeed engine, world of one) over the same rows as one mini-batch, padded and packed
(``actor_train.use_sequence_packing``) in turn, ``--repeats`` times each, every time a fresh engine from the same
initial weights, with seeded random advantages (the speed does not depend on their values): forward, backward and
the optimizer step, timed by the step itself; the best time counts. (Without old log-probs the first step's ratio
is 1, so its pg_loss is the advantages' mean whatever the model computes: the gradient norm is what is compared.)

    python benchmarks/packing.py --rows 64 --model default --dtype fp32
    python benchmarks/packing.py --device cuda --dtype bf16 --samples DIR --model MODEL_DIR   # a GPU machine

Last line: ``RESULT packed_tok_per_s=... padded_tok_per_s=... speedup=... padded_overhead=... max_abs_diff=...
train_packed_tok_per_s=... train_padded_tok_per_s=... train_speedup=... train_grad_norm_rel_diff=...``
(``padded_overhead``: padded tokens / real tokens of the padded log-prob pass).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np

from _common import model_folder, set_up_process


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="default (SmolLM2-135M), tiny, or a model folder")
    parser.add_argument("--samples", default=None, help="a samples table folder (default: generated FrozenLake rows)")
    parser.add_argument("--rows", type=int, default=64, help="generated rows (without --samples)")
    parser.add_argument("--budget", type=int, default=4096, help="max_tokens_per_microbatch_in_infer")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-train", action="store_true", help="measure the log-prob pass only")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="where both passes run (cuda: DeepSpeed on nccl, world of one)")
    parser.add_argument("--attn", default=None, help="Hugging Face attention implementation for both paths "
                        "(default: the model's, sdpa; e.g. flex_attention, whose block mask skips other rows)")
    args = parser.parse_args()
    set_up_process()

    import pyarrow.dataset as pads
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda, but torch sees no CUDA device: run on a GPU machine or use --device cpu")

    from schemas.train_config import PassOptions
    from stages.example import ExampleSpec, generate
    from stages.train.batching import TokenRows
    from stages.train.forward import forward_rows, load_forward_model

    torch.set_num_threads(args.threads)
    folder = args.samples
    if folder is None:
        folder = tempfile.mkdtemp(prefix="rollflow-bench-packing-") + "/samples"
        generate(ExampleSpec(samples=args.rows, seed=0, env="frozenlake", level="step"), folder)
    from stages.storage import Location

    files = Location.of(folder).parquet_files()
    table = pads.dataset(files, format="parquet").to_table(columns=["row_id", "input_ids", "response_mask"])
    rows = TokenRows.from_arrow(table, folder, columns=())
    model = load_forward_model(model_folder(args.model), "log_probs", args.dtype, device=args.device)
    if args.attn:
        model.set_attn_implementation(args.attn)
    for packed in (False, True):  # warm-up (on a GPU: kernels chosen for both shapes of batch)
        forward_rows(model, rows.take(np.arange(min(8, rows.num_rows))), args.budget, device=args.device,
                     options=PassOptions(packed=packed))

    def best(packed: bool):
        runs = []
        for _ in range(args.repeats):
            start = time.perf_counter()  # the log-probs come back to host memory: the pass has ended on the device
            result = forward_rows(model, rows, args.budget, device=args.device, options=PassOptions(packed=packed))
            runs.append((time.perf_counter() - start, result))
        return min(runs, key=lambda r: r[0])

    padded_s, padded = best(False)
    packed_s, packed = best(True)
    diff = float(np.abs(packed.columns["log_probs"].values - padded.columns["log_probs"].values).max())
    real = float(rows.lengths.sum())
    where = (torch.cuda.get_device_name() if args.device == "cuda"
             else f"{args.threads} threads, CPU capability {torch.backends.cpu.get_cpu_capability()}")
    print(f"{rows.num_rows} rows, {int(real):,} tokens (lengths {rows.lengths.min()}-{rows.lengths.max()}), "
          f"budget {args.budget}, {args.dtype}, attention {model.config._attn_implementation}, {where}")
    print(f"{'pass':<8} {'seconds':>8} {'tok/s':>9} {'micro-batches':>14} {'padded tokens':>14}")
    for label, seconds, result in (("padded", padded_s, padded), ("packed", packed_s, packed)):
        print(f"{label:<8} {seconds:>8.2f} {real / seconds:>9.0f} {result.micro_batches:>14} "
              f"{result.padded_tokens:>14,}")
    result = (f"RESULT packed_tok_per_s={real / packed_s:.0f} padded_tok_per_s={real / padded_s:.0f} "
              f"speedup={padded_s / packed_s:.2f} padded_overhead={padded.padded_tokens / real:.3f} "
              f"max_abs_diff={diff:.2e}")
    if not args.no_train:
        del model
        result += " " + train_half(table, folder, args)
    print(result)


def train_half(table, folder: str, args) -> str:
    """One training step padded, then one packed, on the same rows from the same weights → the RESULT fields."""
    import pyarrow as pa
    from gpu_core import synced

    from schemas.config import validate_config
    from schemas.tables import FLOATS
    from schemas.train_config import TrainStepConfig
    from stages.train.batching import TokenRows
    from stages.train.distributed import init_distributed
    from stages.train.engine import Engine
    from stages.train.models import load_actor_model
    from stages.train.step import train_step

    rng = np.random.default_rng(0)
    lengths = [len(x) for x in table.column("input_ids").to_pylist()]
    advantages = pa.array([rng.normal(size=n - 1).astype(np.float32).tolist() for n in lengths], FLOATS)
    rows = TokenRows.from_arrow(table.append_column("advantages", advantages), folder)
    dist = init_distributed(threads=args.threads)  # on a GPU machine: nccl and the CUDA device
    print(f"{'training':<8} {'seconds':>8} {'tok/s':>9} {'padded tokens':>14} {'grad norm':>12}")
    out = {}
    for packed in [False, True] * max(1, args.repeats):  # alternating, fresh engines each time; the best time counts
        cfg = validate_config(TrainStepConfig, {"adv_estimator": "grpo", "compute_entropy_metric": False, "actor_train": {
            "model_args": {"dtype": args.dtype}, "max_tokens_per_microbatch_in_train": args.budget,
            "use_sequence_packing": packed,
            "training_args": {"learning_rate": 1e-6, "per_device_train_batch_size": rows.num_rows}}})
        actor = load_actor_model(model_folder(args.model), cfg.actor_train)
        if args.attn:
            actor.set_attn_implementation(args.attn)
        engine = Engine(actor, cfg.actor_train, dist, "actor")
        step = lambda: train_step(rows, engine, None, cfg, dist, step=0, pad_token_id=0)  # noqa: E731
        if args.device == "cuda":  # the step's own clock may stop before the device has finished
            report, seconds = synced(step)
            report.seconds = seconds
        else:
            report = step()
        label = "packed" if packed else "padded"
        if label not in out or report.seconds < out[label].seconds:
            out[label] = report
        print(f"{label:<8} {report.seconds:>8.2f} {report.tokens / report.seconds:>9.0f} {report.padded_tokens:>14,} "
              f"{report.metrics['actor/grad_norm']:>12.6f}")
        del engine
    a, b = out["packed"], out["padded"]
    return (f"train_packed_tok_per_s={a.tokens / a.seconds:.0f} train_padded_tok_per_s={b.tokens / b.seconds:.0f} "
            f"train_speedup={b.seconds / a.seconds:.2f} "
            f"train_grad_norm_rel_diff={abs(a.metrics['actor/grad_norm'] / b.metrics['actor/grad_norm'] - 1):.2e}")


if __name__ == "__main__":
    main()
