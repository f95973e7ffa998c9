"""Training and forward stages. The DeepSpeed training core (no Ray), one job per module: ``core`` (a training step
from a checkpoint folder to the next, and ``python -m stages.train.core``), ``distributed`` (the process group),
``engine_config`` (an engine's DeepSpeed config), ``engine`` (the DeepSpeed engine of one model), ``models`` (loading
and compiling the models), ``lora`` (adapters, their bases, a checkpoint's LoRA models), ``objectives`` (the
per-micro-batch losses), ``step`` (one PPO training step), ``batching`` (token-budget micro-batches and the step's
plan), ``train_table`` (the rows a step reads), ``resume`` (the engines a step starts from: loaded, replayed or
held), ``save`` (writing the checkpoint folder) and ``checkpoint`` (its layout, reading one back, retention).
Beside it: gradient-free forward passes (``forward``, ``actor_forward`` on the training workers) and the Ray
wrappers (``stage``: the stages; ``group``: the kept worker group of Ray actors)."""
