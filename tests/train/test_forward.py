"""Gradient-free forward passes (no Ray): token-budget batches with padding give each row what an unpadded forward
of that row alone gives; results come back ragged (L - 1 per row) in input order."""

from functools import partial

import numpy as np
import pyarrow as pa
import pytest
import torch
from pydantic import ValidationError
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from schemas.errors import ConfigError
from schemas.train_config import ForwardConfig, ModelArgs, PassOptions, WorkerTrainConfig
from stages.losses import entropy_from_logits, fused_output, log_probs_from_logits
from stages.partials import read_partials, sum_partials
from stages.storage import Location
from stages.train import packed_attention
from stages.train.batching import TokenRows, causal_lm_logits, pad_micro_batch, select_logits
from stages.train.forward import ForwardModels, forward_batch, forward_rows, load_forward_model
from stages.train.lora import wrap
from stages.train.models import load_actor_model, load_critic_model
from stages.train.packed_attention import PACKED_ATTENTION, attention_for, attention_used, set_attention
from stages.train.stage import LOGPROBS, ForwardJob
from tests.train.tables import advantaged_rows


@pytest.fixture(scope="module")
def rows():
    return TokenRows.from_arrow(advantaged_rows(7, lengths=(5, 33), seed=4, multi_turn=True, empty_row=True), "t",
                                columns=())


def one_row_reference(model, rows: TokenRows, b: int):
    """Log-probs and entropy of row b alone (no padding), masked by response_mask[1:] (spec §1.8)."""
    ids = torch.from_numpy(rows.input_ids.row(b)).unsqueeze(0)
    mask = torch.from_numpy(rows.response_mask.row(b))[1:].float()
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1]
    return (log_probs_from_logits(logits, ids[0, 1:]) * mask).numpy(), (entropy_from_logits(logits) * mask).numpy()


@pytest.mark.parametrize("budget", [40, 100000])
def test_log_probs_and_entropy_equal_one_row_at_a_time(tiny_model, rows, budget):
    model = load_actor_model(str(tiny_model)).eval()
    result = forward_rows(model, rows, budget, entropy=True)
    assert result.micro_batches == (1 if budget > 1000 else result.micro_batches) and result.micro_batches >= 1
    lp, ent = result.columns["log_probs"], result.columns["entropy"]
    assert (lp.lengths == rows.lengths - 1).all() and (ent.lengths == rows.lengths - 1).all()
    for b in range(rows.num_rows):
        want_lp, want_ent = one_row_reference(model, rows, b)
        np.testing.assert_allclose(lp.row(b), want_lp, atol=2e-5)
        np.testing.assert_allclose(ent.row(b), want_ent, atol=2e-5)
    assert not lp.row(rows.num_rows - 1).any()  # the row without response tokens: all zero
    assert result.tokens == rows.lengths.sum() and result.padded_tokens >= result.tokens


def test_small_budget_makes_several_micro_batches_with_the_same_result(tiny_model, rows):
    model = load_actor_model(str(tiny_model)).eval()
    small, large = forward_rows(model, rows, 40), forward_rows(model, rows, 100000)
    assert small.micro_batches > 1 and large.micro_batches == 1
    np.testing.assert_allclose(small.columns["log_probs"].values, large.columns["log_probs"].values, atol=2e-5)


def test_values_are_the_critics_raw_outputs_at_every_position(tiny_model, rows):
    critic = load_critic_model(None, str(tiny_model), seed=5).eval()
    values = forward_rows(critic, rows, 64, kind="values").columns["values"]
    for b in range(rows.num_rows):
        ids = torch.from_numpy(rows.input_ids.row(b)).unsqueeze(0)
        with torch.no_grad():
            want = critic(input_ids=ids).logits[0, :-1, 0].numpy()
        np.testing.assert_allclose(values.row(b), want, atol=2e-5)
    seeded = load_forward_model(str(tiny_model), "values", actor_dir=str(tiny_model), seed=5)
    np.testing.assert_allclose(forward_rows(seeded, rows, 64, kind="values").columns["values"].values,
                               values.values, atol=1e-6)


def test_bf16_forward_is_close_to_fp32(tiny_model, rows):
    fp32 = forward_rows(load_forward_model(str(tiny_model), "log_probs"), rows, 256).columns["log_probs"]
    bf16 = forward_rows(load_forward_model(str(tiny_model), "log_probs", "bf16"), rows, 256).columns["log_probs"]
    assert bf16.values.dtype == np.float32
    np.testing.assert_allclose(bf16.values, fp32.values, atol=0.1)


def test_no_rows(tiny_model):
    empty = TokenRows.from_arrow(advantaged_rows(3).slice(0, 0), "t", columns=())
    result = forward_rows(load_actor_model(str(tiny_model)).eval(), empty, 64)
    assert result.columns["log_probs"].num_rows == 0


@pytest.mark.parametrize("budget", [40, 100000])
def test_packed_micro_batches_equal_the_padded_path(tiny_model, rows, budget):
    """Rows packed into one row without padding (positions restarting per row, so each attends to itself only)
    give the padded path's log-probs, entropies and values within float32 rounding, in fewer padded tokens."""
    model = load_actor_model(str(tiny_model)).eval()
    padded = forward_rows(model, rows, budget, entropy=True)
    packed = forward_rows(model, rows, budget, entropy=True, options=PassOptions(packed=True))
    for name in ("log_probs", "entropy"):
        assert (packed.columns[name].offsets == padded.columns[name].offsets).all()
        np.testing.assert_allclose(packed.columns[name].values, padded.columns[name].values, atol=2e-5)
    assert packed.tokens == padded.tokens == packed.padded_tokens == rows.lengths.sum()
    critic = load_critic_model(None, str(tiny_model), seed=5).eval()
    np.testing.assert_allclose(forward_rows(critic, rows, budget, kind="values", options=PassOptions(packed=True))
                               .columns["values"].values,
                               forward_rows(critic, rows, budget, kind="values").columns["values"].values, atol=2e-5)


@pytest.mark.parametrize("packed", [False, True])
def test_the_output_layer_runs_at_the_loss_positions_only(tiny_model, rows, packed):
    """The vocabulary projection sees exactly the hidden states whose next token is a response token, padded or
    packed: not every position, nor the union of the rows' loss positions. The log-probs still equal a forward of each
    row alone with every position projected (test above)."""
    model = load_actor_model(str(tiny_model)).eval()
    seen = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, args, out: seen.append(tuple(args[0].shape)))
    try:
        result = forward_rows(model, rows, 100000, options=PassOptions(packed=packed))
    finally:
        hook.remove()
    union = set()
    for b in range(rows.num_rows):
        union |= set(np.flatnonzero(rows.response_mask.row(b)[1:]).tolist())
    loss_tokens = int(rows.loss_tokens().sum())
    assert seen == [(loss_tokens, model.config.hidden_size)]  # one micro-batch
    assert loss_tokens < rows.num_rows * len(union)  # fewer than Hugging Face's logits_to_keep would project
    for b in range(rows.num_rows):
        np.testing.assert_allclose(result.columns["log_probs"].row(b), one_row_reference(model, rows, b)[0],
                                   atol=2e-5)


@pytest.mark.parametrize("packed", [False, True])
def test_fused_output_layer_equals_the_logits_path(tiny_model, rows, packed):
    """fused: the output layer fused with the reduction (TokenHidden) gives the log-probs and entropy of the logits
    path, here bit-identical (float32 on CPU, every micro-batch in one chunk: the same matmul rows and the same
    reduction), and the output layer itself is handed no position (no (N, V) logits are formed)."""
    model = load_actor_model(str(tiny_model)).eval()
    seen = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, args, out: seen.append(tuple(out.shape)))
    try:
        fused = forward_rows(model, rows, 40, entropy=True, options=PassOptions(packed=packed, fused=True))
    finally:
        hook.remove()
    plain = forward_rows(model, rows, 40, entropy=True, options=PassOptions(packed=packed))
    assert seen and all(0 in shape for shape in seen)
    for name in ("log_probs", "entropy"):
        assert (fused.columns[name].offsets == plain.columns[name].offsets).all()
        np.testing.assert_array_equal(fused.columns[name].values, plain.columns[name].values)


# ---- packed micro-batches through variable-length attention (stages/train/packed_attention.py) ------------------

class TensorShapes(TorchDispatchMode):
    """The shapes of every tensor an operator returns (views included) while the mode is on."""

    def __init__(self):
        super().__init__()
        self.shapes: set[tuple[int, ...]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.shapes.update(tuple(t.shape) for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


def square(shapes: set[tuple[int, ...]], t: int) -> bool:
    """Whether some tensor ended in a (t, t) block: an attention mask or score matrix over the packed row."""
    return any(len(shape) >= 2 and shape[-2:] == (t, t) for shape in shapes)


def test_packed_attention_equals_the_sdpa_block_mask_and_the_padded_forward(tiny_model, rows):
    """attn_implementation fa2 on CPU (causal SDPA per packed row, the fallback of torch's varlen kernel) gives the
    log-probs and entropies of Hugging Face's sdpa over the packed row (its block-diagonal T x T mask) and of the
    padded forward within float32 rounding; its attention function ran once per layer and no (T, T) tensor was
    formed, while the sdpa pass built one (so the spy sees masks). The model's own attention is back after the pass."""
    model = load_actor_model(str(tiny_model)).eval()
    t = int(rows.lengths.sum())  # one micro-batch: the packed row
    assert t not in (model.config.hidden_size, model.config.intermediate_size, model.config.head_dim)
    padded = forward_rows(model, rows, 100000, entropy=True)
    with TensorShapes() as block_mask:
        block = forward_rows(model, rows, 100000, entropy=True, options=PassOptions(packed=True, attention="sdpa"))
    before = packed_attention.calls.copy()
    with TensorShapes() as varlen_pass:
        varlen = forward_rows(model, rows, 100000, entropy=True, options=PassOptions(packed=True, attention="fa2"))
    ran = packed_attention.calls - before
    assert ran == {"segments": model.config.num_hidden_layers}
    assert square(block_mask.shapes, t) and not square(varlen_pass.shapes, t)
    assert model.config._attn_implementation == "sdpa"
    for name in ("log_probs", "entropy"):
        assert (varlen.columns[name].offsets == padded.columns[name].offsets).all()
        np.testing.assert_allclose(varlen.columns[name].values, block.columns[name].values, atol=2e-5)
        np.testing.assert_allclose(varlen.columns[name].values, padded.columns[name].values, atol=2e-5)


def loss_gradients(model, mb, attention: str, packed: bool) -> dict[str, torch.Tensor]:
    """The gradients of a weighted sum of ``mb``'s log-probs (a policy-gradient-shaped loss) under ``attention``."""
    model.zero_grad()
    weights = torch.linspace(-1.0, 1.0, mb.loss_mask.numel()).reshape(mb.loss_mask.shape)
    with attention_used(model, attention_for(attention, packed, "cpu")):
        logits = select_logits(partial(causal_lm_logits, model), mb, packed)
    (logits.log_probs(mb) * weights).sum().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def test_packed_attention_gradients_equal_the_sdpa_block_mask_and_the_padded_ones(tiny_model, rows):
    """Training runs the same attention backward: the gradients of a loss of the packed log-probs under fa2 equal
    those of sdpa's block-mask pass and of the padded batch within float32 rounding."""
    model = load_actor_model(str(tiny_model))
    mb = pad_micro_batch(rows, np.arange(rows.num_rows))
    before = packed_attention.calls.copy()
    varlen = loss_gradients(model, mb, "fa2", packed=True)
    assert (packed_attention.calls - before)["segments"] == model.config.num_hidden_layers
    block, padded = loss_gradients(model, mb, "sdpa", packed=True), loss_gradients(model, mb, "sdpa", packed=False)
    assert any(g.abs().max() > 1e-3 for g in varlen.values())
    for name, grad in varlen.items():
        torch.testing.assert_close(grad, block[name], atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(grad, padded[name], atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")


def test_inputs_that_are_not_packed_run_sdpa_unchanged(tiny_model, rows):
    """Under the packed attention, a padded batch of several rows and a single row (positions without a restart)
    give bit-identical logits to Hugging Face's sdpa: its attention function hands them to sdpa as they came."""
    model = load_actor_model(str(tiny_model)).eval()
    mb = pad_micro_batch(rows, np.arange(rows.num_rows))
    single = pad_micro_batch(rows, np.array([0]))
    with torch.no_grad():
        want = [model(input_ids=b.input_ids, position_ids=b.position_ids).logits for b in (mb, single)]
        before = packed_attention.calls.copy()
        with attention_used(model, PACKED_ATTENTION):
            assert model.config._attn_implementation == PACKED_ATTENTION
            got = [model(input_ids=b.input_ids, position_ids=b.position_ids).logits for b in (mb, single)]
    assert packed_attention.calls - before == {"sdpa": 2 * model.config.num_hidden_layers}
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_segment_offsets_read_the_restarts_of_the_position_ids():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1, 2, 3]])
    assert packed_attention.segment_offsets(positions).tolist() == [0, 3, 5, 6, 10]
    assert packed_attention.segment_offsets(torch.arange(5)[None]).tolist() == [0, 5]


def test_the_varlen_kernel_call_is_well_formed():
    """torch's varlen_attn (its shape-only implementation, on meta tensors: the kernel itself needs CUDA) takes the
    call the packed attention makes on CUDA, grouped key/value heads included, and gives (1, T, Hq, D) back."""
    query = torch.empty(1, 4, 10, 64, device="meta", dtype=torch.bfloat16)
    key = torch.empty(1, 2, 10, 64, device="meta", dtype=torch.bfloat16)
    offsets = packed_attention.segment_offsets(torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 5, 6]]))
    out = packed_attention.varlen_attention(query, key, key, offsets, 0.125)
    assert out.shape == (1, 10, 4, 64) and out.dtype == torch.bfloat16
    assert not packed_attention.varlen_runs(torch.empty(1, 4, 10, 64), 0.0, 0.125)  # CPU: per-segment SDPA


def test_attn_implementation_resolution_dump_and_refusals(tiny_model):
    """auto: the packed attention on CUDA with packing, sdpa otherwise (so CPU runs and config hashes are as
    before: auto is left out of the dump); fa2 and sdpa as written (flash_attention_2, ROLL's spelling, reads as
    fa2); fa2 without packing, an unknown value and a model without transformers' attention interface are refused
    with the fix."""
    assert [attention_for("auto", p, d) for p, d in ((True, "cuda"), (True, "cpu"), (False, "cuda"))] == [
        PACKED_ATTENTION, "sdpa", "sdpa"]
    assert attention_for("fa2", True, "cpu") == PACKED_ATTENTION and attention_for("sdpa", True, "cuda") == "sdpa"
    assert "attn_implementation" not in ModelArgs().model_dump() and "attn_implementation" not in (
        ForwardConfig().model_dump())
    assert ModelArgs(attn_implementation="flash_attention_2").model_dump()["attn_implementation"] == "fa2"
    packed = WorkerTrainConfig(use_sequence_packing=True, model_args={"attn_implementation": "fa2"})
    assert WorkerTrainConfig.model_validate(packed.model_dump()) == packed
    for build in (lambda: WorkerTrainConfig(model_args={"attn_implementation": "fa2"}),
                  lambda: ForwardConfig(attn_implementation="fa2")):
        with pytest.raises(ValidationError, match="use_sequence_packing: true, or attn_implementation: auto"):
            build()
    with pytest.raises(ValidationError):
        ModelArgs(attn_implementation="eager")
    with pytest.raises(ConfigError, match="model_args.attn_implementation: sdpa"):
        set_attention(torch.nn.Linear(2, 2), PACKED_ATTENTION, "model_args.attn_implementation")
# ---- logprobs.fused_output_layer: the log-prob pass without the (N, V) logits ----------------------------------------

CHUNK = 8  # positions per chunk of the fused output layer in these tests: far fewer than a micro-batch's loss tokens


class VocabRows(TorchDispatchMode):
    """The most positions of any tensor an op creates (views left out) whose last dimension is the vocabulary: N
    for (N, V) logits (and their float32 copy, softmax, ...), a chunk's positions for the fused output layer."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.rows = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == self.vocab:
                    self.rows = max(self.rows, t.numel() // self.vocab)
        return out


def _columns(table: pa.Table, names) -> dict[str, np.ndarray]:
    return {n: np.concatenate([np.asarray(r, np.float32) for r in table.column(n).to_pylist()]) for n in names}


def fused_tolerance(values: np.ndarray, vocab: int) -> float:
    """8 float32 ulps of the largest log-sum-exp involved (|log p| + log V bounds it; about 2e-5 here): both paths
    reduce float32 logits with the same expressions (stages/losses/fused_output.py), but the fused side projects CHUNK
    positions at a time, so the matmul's blocking over a different row count may round a logit differently, and a
    log-prob or entropy carries that rounding at the log-sum-exp's magnitude (test_fused_output.py's bound)."""
    return 8 * float(np.finfo(np.float32).eps) * (float(np.abs(values).max()) + float(np.log(vocab)))


def _fused_and_plain(run, vocab: int):
    """``run(fused)`` → a table, with fused off then on; and the most positions a vocabulary-wide tensor had."""
    out, rows = {}, {}
    for fused in (False, True):
        with VocabRows(vocab) as seen:
            out[fused] = run(fused)
        rows[fused] = seen.rows
    return out, rows


@pytest.mark.parametrize("packed", [False, True])
def test_fused_log_prob_batch_equals_the_logits_path_without_the_logits(tiny_model, tmp_path, monkeypatch, packed):
    """forward_batch with fused (on a worker's kept models, ForwardModels, as each rank runs it; padded and packed
    micro-batches): old
    log-probs (and the reference copy) and entropy equal the logits path's within float32 rounding
    (:func:`fused_tolerance`; measured 0 here), while no tensor of the pass is wider
    than CHUNK positions by the vocabulary — the logits path forms all N (every loss token of the one micro-batch).
    The counter says so: ``fused_micro_batches`` 1, and absent with fused off (the stage's metrics as before)."""
    monkeypatch.setattr(fused_output, "FUSED_CHUNK_ELEMENTS", CHUNK * 49152)  # the tiny model's vocabulary
    table = advantaged_rows(7, lengths=(5, 33), seed=4, multi_turn=True, empty_row=True)
    loss_tokens = int(TokenRows.from_arrow(table, "t", columns=()).loss_tokens().sum())
    job = ForwardJob("log_probs", str(tiny_model), "old_log_probs", ("ref_log_probs",), entropy=True,
                     fingerprint="f")
    models = ForwardModels()
    vocab = models.get(job.column, job.path, job.kind, "fp32", fingerprint="f").config.vocab_size
    assert vocab == 49152 and loss_tokens > 4 * CHUNK

    def run(fused: bool) -> pa.Table:
        kept = models.get(job.column, job.path, job.kind, "fp32", fingerprint="f")
        return forward_batch([kept], [job], table, 100000, Location.of(str(tmp_path / str(fused))), LOGPROBS, "t",
                             options=PassOptions(packed=packed, fused=fused))

    out, rows = _fused_and_plain(run, vocab)
    assert rows[False] >= loss_tokens and rows[True] == CHUNK
    names = ("old_log_probs", "ref_log_probs", "entropy")
    plain, fused = _columns(out[False], names), _columns(out[True], names)
    for name in names:
        assert out[True].column(name).type == out[False].column(name).type
        np.testing.assert_allclose(fused[name], plain[name], rtol=0, atol=fused_tolerance(plain[name], vocab),
                                   err_msg=name)
    counters = {f: sum_partials(read_partials(Location.of(str(tmp_path / str(f))))) for f in (False, True)}
    assert counters[True]["fused_micro_batches"] == 1 and "fused_micro_batches" not in counters[False]
    assert models.loads == {"fresh": 1, "in_place": 0, "kept": 2}
    fresh = load_forward_model(job.path, job.kind, "fp32")  # a model loaded for one request: the same pass
    assert forward_batch([fresh], [job], table, 100000, Location.of(str(tmp_path / "pool")), LOGPROBS, "t",
                         options=PassOptions(packed=packed, fused=True)).equals(out[True])
    assert sum_partials(read_partials(Location.of(str(tmp_path / "pool"))))["fused_micro_batches"] == 1


def test_fused_lora_pass_and_its_base_pass_equal_the_logits_path(tiny_model, tmp_path, monkeypatch):
    """A LoRA model (adapter B randomised, so the policy differs from its base): the old log-probs with the adapter
    on and the reference from the base pass (adapter off, ``base_column``) both run fused — two fused micro-batches,
    none wider than CHUNK positions — and equal the logits path within float32 rounding (:func:`fused_tolerance`;
    measured 9.5e-7)."""
    monkeypatch.setattr(fused_output, "FUSED_CHUNK_ELEMENTS", CHUNK * 49152)
    model = wrap(load_actor_model(str(tiny_model)), ModelArgs(lora_rank=4, lora_alpha=16), "actor", seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    model.eval()
    table = advantaged_rows(6, lengths=(8, 30), seed=2, multi_turn=True)
    job = ForwardJob("log_probs", str(tiny_model), "old_log_probs", entropy=True, adapter="a",
                     base_column="ref_log_probs")
    vocab = model.config.vocab_size

    def run(fused: bool) -> pa.Table:
        return forward_batch([model], [job], table, 100000, Location.of(str(tmp_path / str(fused))), LOGPROBS, "t",
                             options=PassOptions(fused=fused))

    out, rows = _fused_and_plain(run, vocab)
    assert rows[True] == CHUNK < rows[False]
    names = ("old_log_probs", "ref_log_probs", "entropy")
    plain, fused = _columns(out[False], names), _columns(out[True], names)
    for name in names:
        np.testing.assert_allclose(fused[name], plain[name], rtol=0, atol=fused_tolerance(plain[name], vocab),
                                   err_msg=name)
    assert np.abs(plain["old_log_probs"] - plain["ref_log_probs"]).max() > 1e-3  # the adapter matters
    assert sum_partials(read_partials(Location.of(str(tmp_path / "True"))))["fused_micro_batches"] == 2


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")  # peft: the adapted lm_head is tied
def test_fused_pass_refuses_a_lora_adapter_on_the_output_layer(tiny_model, rows):
    """LoRA on lm_head: the output layer is no plain linear layer (switching the adapter off does not unwrap it),
    so logprobs.fused_output_layer: true is refused before the first micro-batch, naming the option and the fix;
    the logits path runs it."""
    model = wrap(load_actor_model(str(tiny_model)), ModelArgs(lora_rank=4, lora_target_modules=["q_proj", "lm_head"]),
                 "actor", seed=0).eval()
    with pytest.raises(ConfigError, match="logprobs.fused_output_layer: false"):
        forward_rows(model, rows, 100000, options=PassOptions(fused=True))
    with model.disable_adapter(), pytest.raises(ConfigError, match="not a plain torch.nn.Linear"):
        forward_rows(model, rows, 100000, options=PassOptions(fused=True))
    assert forward_rows(model, rows, 100000).columns["log_probs"].num_rows == rows.num_rows


@pytest.mark.parametrize("device, auto", [("cpu", False), ("cuda", True)])
def test_fused_output_layer_option_resolves_on_the_sections_device(device, auto):
    """auto → true with device: cuda, false with device: cpu (the section's device, whatever this host is); an
    explicit value is kept. The dump leaves the option out while it is auto's value, so every config without it
    dumps (and hashes) as before the option, and the dump reads back to the same config. The section's pass options
    (what every pass runs under) carry the resolved value, packing, and attn_implementation as written (its auto is
    resolved by the device the pass runs on: test_attn_implementation_resolution_dump_and_refusals)."""
    default = ForwardConfig(device=device)
    assert default.fused_output_layer is auto
    assert default.pass_options() == PassOptions(packed=False, attention="auto", fused=auto)
    varlen = ForwardConfig(device=device, use_sequence_packing=True, attn_implementation="flash_attention_2")
    assert varlen.pass_options() == PassOptions(packed=True, attention="fa2", fused=auto)
    assert ForwardConfig(device=device, fused_output_layer="auto") == default
    before = {k: v for k, v in ForwardConfig(device=device).model_dump(mode="json").items()}
    assert "fused_output_layer" not in before and "fused_output_layer" not in default.model_fields_set
    for value in (True, False):
        chosen = ForwardConfig(device=device, fused_output_layer=value)
        dump = chosen.model_dump(mode="json")
        assert chosen.fused_output_layer is value and chosen.pass_options().fused is value
        assert ("fused_output_layer" in dump) is (value is not auto)
        assert ForwardConfig.model_validate(dump) == chosen
    with pytest.raises(ValueError, match="fused_output_layer"):
        ForwardConfig(fused_output_layer="sometimes")
