"""Training and forward stages: the DeepSpeed training core (``core``, no Ray), token-budget batching
(``batching``), gradient-free forward passes (``forward``: log-probs, entropy, values), checkpoints
(``checkpoint``) and the Ray wrappers (``stage``: Ray Train TorchTrainer, Ray Data actor pools)."""
