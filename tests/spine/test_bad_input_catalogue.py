"""The bad-input catalogue of every ``rollflow`` command (issue 17, item 6), beyond the table commands' own files.

Each case runs one command in-process on a bad input and asserts the user-error contract: exit status 2, one
``error:`` message with the phrases that name what is wrong, where, and the fix, no traceback, and nothing
committed — the whole working folder (configs, tables, run folders, outputs) and the shared input tables are
unchanged, byte for byte. Ray and Prefect are switched off for these tests (:func:`no_services`): every case must be
refused by a pre-flight check before either would start, so each takes a fraction of a second.

Organisation (ids are ``<command>-<what is bad>``):

* ``TRAIN`` — ``rollflow train`` with an agentic config: arguments, config file, ``--set``, option values,
  environments (unknown type, impossible map size, unknown keyword, missing data), paths (run folder under a file,
  ``pretrain`` that is not a model folder) and run-folder states (started with another config, ``--resume`` of a
  folder that is not a run, a damaged frozen config.json, a run folder moved away from the one its config names,
  ``--set`` on a resume).
* ``PLAN`` — ``rollflow plan``: config file, ``--set``, and plans the cluster cannot schedule (GPUs, CPUs).
* ``RLVR`` — ``rollflow train`` with an RLVR config: reward workers (unknown, bad kwargs, not importable, a run-time
  service given as a kwarg), prompt files, group sizes, validation routes.
* ``EVAL`` — ``rollflow eval`` (agentic and RLVR configs): checkpoints, output paths, validation workers and prompts.
* ``ROLLOUT`` — ``rollflow rollout``: environments, generation and engine options, paths, checkpoints.
* ``SCORE`` — ``rollflow score`` beyond tests/spine/test_bad_input_commands.py: reward workers and routes, the domain
  column, and model outputs that cannot be read (a null or non-text ``response``).
* ``FORWARD`` — ``logprobs`` / ``values`` / ``train-step``: model folders that are not checkpoints, config values.
* ``STAGE`` — ``rollflow stage``: unknown stage, a folder that is not that stage's output (a rollout turn's too),
  bad ``--set``, recorded inputs that are gone, an output that is a file, ``--checkpoint`` for a stage that is not a
  rollout (the rollout replay's own refusals: tests/rollout/test_rollout_flow.py).
* ``FOLDERS`` — ``lineage``, ``report``, ``inspect``, ``validate``, ``show`` on paths that are not what they read,
  and stored folders that are damaged (a manifest that is not an object, lacks a field its reader needs or
  has one of the wrong type; part files that are not those the manifest lists).
* ``TOOLS`` — ``example``, ``rlvr-example``, ``demo``, ``deploy``, ``server``: option values and paths.
* ``USAGE`` — Click's own refusals (unknown or missing options): exit 2 with the option named, no traceback.

``recompute`` and ``validate`` on bad tables and configs are catalogued in tests/spine/test_bad_input.py, ``score``,
``logprobs``, ``values`` and ``train-step`` on bad tables in tests/spine/test_bad_input_commands.py, and random
corruptions in tests/spine/test_bad_input_property.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest
from typer.testing import CliRunner

from flows.cli import app
from stages.example import ExampleSpec, generate
from stages.model_files import file_states
from tests.spine.conftest import SMALL
from tests.spine.helpers import GIGPO, REPO, config, read_table, replace_value, set_column, tree_digest, write_samples
from tests.spine.test_bad_input import assert_user_error
from tests.spine.test_bad_input_commands import _advantaged

runner = CliRunner()

QUICK = str(REPO / "configs/train_frozenlake_quickstart.yaml")
RLVR_TRAIN = str(REPO / "configs/rlvr_train_math.yaml")
ROLLOUT = str(REPO / "configs/rollout_frozenlake.yaml")
RLVR_SCORE = str(REPO / "configs/rlvr_math.yaml")
H100 = str(REPO / "configs/train_frozenlake_grpo_h100.yaml")

# ---- the catalogue: id -> (argv, phrases the message must contain) ----------------------------------------------
# argv may name @quick, @rlvr, @rollout, @score_config, @responses, @samples, @advantaged, @model, @port and the entries
# of the working folder the fixture `work` makes: afile (a file), emptydir/, notckpt/ (a folder without a model),
# noweights/ (config.json only), notyaml.yaml, list.yaml, other_runs/quickstart (a run frozen with another config),
# moved_runs/quickstart (a copy of it), damaged_runs/quickstart and list_runs/quickstart (runs whose config.json is not
# JSON / a list), ckpt_runs/quickstart (a run whose last checkpoint's train_state.json is not JSON),
# replay_runs/quickstart (one whose last checkpoint replays from one with damaged DeepSpeed state), rollout_bad/ (a
# rollout whose episodes/ part file is not Parquet), run_bad_turn/ (a run whose last turn table's part file is not
# Parquet), run_report_file/ (a run whose report/ is a file), run_metrics_file/ (a run whose metrics/ is a file),
# stage_out/ (an advantages output whose inputs are gone), stage_ok/ (one whose inputs exist), stage_no_state/ (one
# without state_in), chain/first and chain/reader (an advantages output and one reading it without a section),
# ro_turn/turns/turn_001 (a turn table that records no previous table); and the shared damaged copies of @samples:
# @manifest_* (its manifest.json damaged), @reads_no_fingerprint, @part_* (its part files changed); small checkpoints
# with a damaged file, @ckpt_* (CHECKPOINT_DAMAGES), and stage outputs that recorded one, @train_step_out and @eval_out.

TRAIN = {
    "train-no-config": (["train"], ["pass either --config FILE (a new run) or --resume RUN_DIR"]),
    "train-config-and-resume": (["train", "--config", "@quick", "--resume", "emptydir"],
                                ["pass either --config FILE", "or --resume RUN_DIR"]),
    "train-config-missing": (["train", "--config", "nope.yaml"], ["nope.yaml does not exist",
                                                                  "pass a file from configs/"]),
    "train-config-not-yaml": (["train", "--config", "notyaml.yaml"], ["notyaml.yaml is not valid YAML"]),
    "train-config-not-mapping": (["train", "--config", "list.yaml"], ["list.yaml must hold a mapping of options"]),
    "train-set-unknown-key": (["train", "--config", "@quick", "--set", "max_stepz=3"],
                              ["field 'max_stepz'", "unknown option", "check the spelling"]),
    "train-set-not-yaml": (["train", "--config", "@quick", "--set", "max_steps=[1"],
                           ["override 'max_steps=[1'", "is not valid YAML", "quote it"]),
    "train-set-key-twice": (["train", "--config", "@quick", "--set", "rollout.env={group_size: 4, group_size: 8}"],
                            ["is not valid YAML", "key 'group_size' appears twice in one mapping",
                             "remove one of them"]),
    "train-set-without-value": (["train", "--config", "@quick", "--set", "max_steps"],
                                ["override 'max_steps' must look like key=value"]),
    "train-set-invalid-value": (["train", "--config", "@quick", "--set", "max_steps=0"],
                                ["field 'max_steps'", "greater than 0"]),
    "train-set-not-a-finite-number": (["train", "--config", "@quick", "--set", "train.pg_clip=nan"],
                                      ["field 'train.pg_clip'", "must be a finite number, not 'nan'",
                                       "write a number"]),
    "train-unknown-pipeline": (["train", "--config", "@quick", "--set", "pipeline=ppo"],
                               ["pipeline 'ppo' is unknown", "set pipeline to one of ['agentic', 'rlvr']"]),
    "train-pipeline-not-a-name": (["train", "--config", "@quick", "--set", "pipeline=[agentic]"],
                                  ["pipeline ['agentic'] is unknown", "set pipeline to one of ['agentic', 'rlvr']"]),
    "train-section-not-a-mapping": (["train", "--config", "@quick", "--set", "train=[1]"],
                                    ["field 'train'", "Input should be a valid dictionary"]),
    "train-empty-list-section": (["train", "--config", "@quick", "--set", "logprobs=[]"],
                                 ["field 'logprobs'", "Input should be a valid dictionary"]),
    "train-runtime-not-a-mapping": (["train", "--config", "@quick", "--set", "runtime=4"],
                                    ["field 'runtime'", "Input should be a valid dictionary"]),
    "train-section-runtime-not-a-mapping": (["train", "--config", "@quick", "--set", "rollout.runtime=4"],
                                            ["field 'rollout.runtime'", "Input should be a valid dictionary"]),
    "train-batch-not-divisible": (["train", "--config", "@quick", "--set", "rollout_batch_size=7"],
                                  ["rollout_batch_size (7) must be divisible by rollout.env.group_size (4)",
                                   "set rollout_batch_size to 8"]),
    "train-unknown-env-type": (["train", "--config", "@quick", "--set", "rollout.env.tag=Chess"],
                               ["rollout.env.tag 'Chess' is not a registered environment", "use one of:",
                                "FrozenLake"]),
    "train-env-impossible-map-size": (["train", "--config", "@quick", "--set", "rollout.env.env_config={size: 1}"],
                                      ["rollout.env.env_config", "size must be >= 2", "got size=1",
                                       "fix the env_config"]),
    "train-env-unknown-keyword": (["train", "--config", "@quick", "--set", "rollout.env.env_config={colour: red}"],
                                  ["rollout.env.env_config", "unexpected keyword argument 'colour'",
                                   "allowed keys are the parameters of"]),
    "train-env-needs-data": (["train", "--config", "@quick", "--set", "rollout.env.tag=GemMath"],
                             ["environment 'GemMath' needs data", "rollout.env.env_config.data_path"]),
    "train-unknown-engine-option": (["train", "--config", "@quick", "--set", "rollout.engine.options={bogus: 1}"],
                                    ["rollout.engine.options: 'bogus' is not an option of the 'vllm' generation "
                                     "backend", "kv_cache_space_gib"]),
    "train-grouping-names-no-column": (["train", "--config", "@quick", "--set", "reward_normalization.grouping=''"],
                                       ["field 'reward_normalization.grouping'",
                                        "'batch', 'traj_group_id', 'tags', 'traj_id', 'group_id' or 'tag'"]),
    "train-rl-loss-coef-of-the-rlvr-loss": (["train", "--config", "@quick", "--set", "train.rl_loss_coef=0.5"],
                                            ["field 'train'", "rl_loss_coef (0.5) is read only by the rlvr policy "
                                             "loss, but policy_loss is agentic, which ignores it",
                                             "set policy_loss: rlvr, or remove rl_loss_coef"]),
    "train-runs-dir-under-a-file": (["train", "--config", "@quick", "--set", "runs_dir=afile"],
                                    ["afile/quickstart lies under", "which is a file", "pass a folder path"]),
    "train-pretrain-not-a-model": (["train", "--config", "@quick", "--set", "pretrain=notckpt"],
                                   ["model folder notckpt has no config.json", "pass an HF-format checkpoint folder"]),
    "train-pretrain-without-weights": (["train", "--config", "@quick", "--set", "pretrain=noweights"],
                                       ["model folder noweights has no *.safetensors weights", "save_pretrained"]),
    "train-run-folder-of-another-config": (["train", "--config", "@quick", "--set", "runs_dir=other_runs"],
                                           ["other_runs/quickstart was started with another config",
                                            "rollflow train --resume", "or choose a new run_name"]),
    "train-resume-not-a-run": (["train", "--resume", "emptydir"], ["emptydir has no config.json",
                                                                   "pass the folder of a run started by"]),
    "train-resume-config-not-json": (["train", "--resume", "damaged_runs/quickstart"],
                                     ["run config", "damaged_runs/quickstart/config.json is not valid JSON",
                                      "restore it from a copy, or start a new run (another run_name)"]),
    "train-run-config-not-a-mapping": (["train", "--config", "@quick", "--set", "runs_dir=list_runs"],
                                       ["run config", "list_runs/quickstart/config.json is not a mapping of options",
                                        "restore it from a copy"]),
    "train-resume-moved-run": (["train", "--resume", "moved_runs/quickstart"],
                               ["moved_runs/quickstart/config.json names the run folder", "other_runs/quickstart",
                                "the folder was moved or copied", "resume it from the directory it was started in, "
                                "or move it back"]),
    "train-resume-last-checkpoint-damaged": (["train", "--resume", "ckpt_runs/quickstart"],
                                             ["model folder", "ckpt_runs/quickstart/iter_0000/checkpoint: "
                                              "train_state.json is not valid JSON", "restore the folder from a copy",
                                              "deleting iter_<k> and the iterations after it and resuming the run"]),
    "train-resume-replay-origin-damaged": (["train", "--resume", "replay_runs/quickstart"],
                                           ["model folder", "replay_runs/quickstart/iter_0000/checkpoint: deepspeed/"
                                            "actor/state/mp_rank_00_model_states.pt is not a whole torch file"]),
    "train-resume-with-set": (["train", "--resume", "other_runs/quickstart", "--set", "max_steps=3"],
                              ["--set cannot change a run being resumed", "start a new run"]),
    "train-zero-stage-unknown": (["train", "--config", "@quick", "--set",
                                  "train.actor_train.strategy_args.zero_stage=4"],
                                 ["field 'train.actor_train.strategy_args.zero_stage'", "should be 0, 1, 2 or 3"]),
    "train-zero-stage-set-twice": (["train", "--config", "@quick", "--set", "train.actor_train.strategy_args."
                                    "deepspeed_config={zero_optimization: {stage: 3}}"],
                                   ["field 'train.actor_train.strategy_args'", "zero_optimization.stage (3) differs "
                                    "from zero_stage (2)", "set the stage once, in strategy_args.zero_stage"]),
    "train-offload-param-below-zero3": (["train", "--config", "@quick", "--set", "train.actor_train.strategy_args."
                                         "deepspeed_config={zero_optimization: {offload_param: {device: cpu}}}"],
                                        ["zero_optimization.offload_param needs zero_stage >= 3", "but zero_stage is 2",
                                         "set zero_stage: 3, or remove offload_param"]),
    "train-offload-unknown-device": (["train", "--config", "@quick", "--set", "train.actor_train.strategy_args."
                                      "deepspeed_config={zero_optimization: {offload_optimizer: {device: disk}}}"],
                                     ["offload_optimizer.device is 'disk'", "one of ['none', 'cpu', 'nvme']",
                                      "write offload_optimizer: {device: cpu}"]),
    "train-offload-nvme-without-path": (["train", "--config", "@quick", "--set", "train.actor_train.strategy_args."
                                         "deepspeed_config={zero_optimization: {offload_optimizer: {device: nvme}}}"],
                                        ["offload_optimizer: device nvme needs nvme_path", "add nvme_path"]),
    "train-offload-on-cpu-workers": (["train", "--config", "@quick", "--set", "train.actor_train.strategy_args="
                                      "{zero_stage: 3, deepspeed_config: {zero_optimization: {offload_optimizer: "
                                      "{device: cpu}}}}"],
                                     ["field 'train'", "actor_train.strategy_args.deepspeed_config.zero_optimization."
                                      "offload_optimizer moves GPU state to host memory", "runtime.use_gpu: false",
                                      "remove offload_optimizer, or set runtime.use_gpu: true"]),
    "train-value-clip-zero": (["train", "--config", "@quick", "--set", "adv_estimator=gae", "--set",
                               "train.value_clip=0"],
                              ["field 'train'", "value_clip (0.0) must be null or > 0",
                               "set value_clip: null to turn value clipping off"]),
    "train-lora-with-zero3": (["train", "--config", "@quick", "--set", "train.actor_train={model_args: {lora_rank: 8}, "
                               "strategy_args: {zero_stage: 3}}"],
                              ["field 'train.actor_train'", "model_args.lora_rank with strategy_args.zero_stage 3 is "
                               "not supported", "set zero_stage: 2"]),
}

PLAN = {
    "plan-config-missing": (["plan", "--config", "nope.yaml"],
                            ["nope.yaml does not exist", "pass a file from configs/"]),
    "plan-set-unknown-key": (["plan", "--config", "@quick", "--set", "max_stepz=3"],
                             ["field 'max_stepz'", "unknown option"]),
    # the log-probs run on the kept training group (issue 44): two roles on the GPU, not three
    "plan-one-gpu-for-two-apart": (["plan", "--config", "@h100", "--cpus", "16", "--gpus", "1", "--set",
                                    "rollout.engine.device_mapping=null", "--set", "logprobs.device_mapping=null",
                                    "--set", "train.runtime.device_mapping=null"],
                                   ["the run needs 2 GPUs of Ray's 1", "share a GPU only when colocated",
                                    "Set rollout.engine.device_mapping: [0] and rollout.engine.sleep_level: 1",
                                    "or use a machine", "with 2 GPUs"]),
    "plan-colocated-without-sleep": (["plan", "--config", "@h100", "--set", "rollout.engine.sleep_level=0"],
                                     ["rollout.engine.device_mapping equals logprobs.device_mapping and train.runtime.device_mapping",
                                      "sleep_level is 0", "set rollout.engine.sleep_level: 1"]),
    "plan-cpus-for-the-log-prob-actor": (["plan", "--config", "@quick", "--cpus", "2", "--gpus", "0", "--set",
                                          "logprobs.cpus_per_actor=2", "--set", "train.runtime.keep_workers=false"],
                                         ["the run needs 2.5 CPUs of Ray's 2", "logprobs.cpus_per_actor"]),
    "plan-cpus-for-no-log-prob-actor": (["plan", "--config", "@quick", "--set", "logprobs.cpus_per_actor=2"],
                                        ["logprobs.cpus_per_actor is 2, but no forward worker reserves it",
                                         "set train.runtime.keep_workers: false"]),
}

RLVR = {
    "rlvr-unknown-worker": (["train", "--config", "@rlvr", "--set", "rewards.routes.math.worker=mathrule"],
                            ["rewards.routes.math: unknown reward worker 'mathrule'", "registered:", "math_rule",
                             "'module:name'"]),
    "rlvr-worker-bad-kwargs": (["train", "--config", "@rlvr", "--set", "rewards.routes.math.kwargs={bogus: 1}"],
                               ["rewards.routes.math: reward worker 'math_rule': bad kwargs ['bogus']",
                                "see the worker's docstring"]),
    "rlvr-custom-worker-not-importable": (["train", "--config", "@rlvr", "--set",
                                           "rewards.routes.math.worker=no_such_module:Scorer"],
                                          ["cannot import module 'no_such_module'", "put it on PYTHONPATH"]),
    "rlvr-custom-worker-missing-name": (["train", "--config", "@rlvr", "--set",
                                         "rewards.routes.math.worker=stages.rewards:NoSuchWorker"],
                                        ["module 'stages.rewards' has no attribute 'NoSuchWorker'"]),
    "rlvr-service-given-as-kwarg": (["train", "--config", "@rlvr", "--set",
                                     "rewards.routes.math={worker: llm_judge, kwargs: {generate: x}}"],
                                    ["rewards.routes.math", "'generate' is a run-time service given by the stage",
                                     "remove it from the worker kwargs"]),
    # prompt files are read whole in the pre-flight (issue 48); before, an empty one crashed with an Arrow error and
    # a line without a field was reported after Ray started and the run folder was written
    "rlvr-prompt-file-empty": (["train", "--config", "@rlvr", "--set", "prompts.data_dir=prompts_empty"],
                               ["prompts: prompts file prompts_empty/math.jsonl holds no prompts",
                                "or remove 'math' from prompts.domains"]),
    "rlvr-prompt-line-without-field": (["train", "--config", "@rlvr", "--set", "prompts.data_dir=prompts_field"],
                                       ["prompts file prompts_field/math.jsonl, line 2: KeyError('ground_truth')",
                                        "each line must be a JSON object with id, prompt and ground_truth"]),
    "rlvr-prompt-line-not-an-object": (["train", "--config", "@rlvr", "--set", "prompts.data_dir=prompts_list"],
                                       ["prompts_list/math.jsonl, line 1", "not a JSON object"]),
    "rlvr-prompt-file-not-utf8": (["train", "--config", "@rlvr", "--set", "prompts.data_dir=prompts_latin1"],
                                  ["prompts_latin1/math.jsonl is not UTF-8 text", "save it as UTF-8"]),
    "eval-rlvr-validation-prompts-empty": (["eval", "--config", "@rlvr", "--output", "out", "--set",
                                            "validation.prompts.data_dir=prompts_empty", "--set",
                                            "validation.prompts.domains=[math]", "--set",
                                            "validation.rewards={routes: {math: {worker: math_rule}}}"],
                                           ["validation.prompts: prompts file prompts_empty/math.jsonl holds no "
                                            "prompts"]),
    "rlvr-unknown-prompt-domain": (["train", "--config", "@rlvr", "--set", "prompts.domains=[chemistry]"],
                                   ["prompts:", "chemistry.jsonl does not exist", "prompts.domains must name JSONL",
                                    "found: add2_heldout, add2_train, code, ifeval, math, mcq"]),
    "rlvr-generating-args-not-a-mapping": (["train", "--config", "@rlvr", "--set", "generating_args=128"],
                                           ["field 'generating_args'", "Input should be a valid dictionary"]),
    "rlvr-negative-rl-loss-coef": (["train", "--config", "@rlvr", "--set", "train.rl_loss_coef=-1"],
                                   ["field 'train.rl_loss_coef'", "greater than 0"]),
    "rlvr-unknown-engine-option": (["train", "--config", "@rlvr", "--set", "engine.options={bogus: 1}"],
                                   ["engine.options: 'bogus' is not an option of the 'vllm' generation backend",
                                    "kv_cache_space_gib"]),
    "rlvr-unknown-judge-engine-option": (["train", "--config", "@rlvr", "--set",
                                          "rewards.routes.math={worker: llm_judge}", "--set",
                                          "judge.engine.options={bogus: 1}"],
                                         ["judge.engine.options: 'bogus' is not an option of the"]),
    # the LLM judge's settings are read only by a route that calls a model: set without one, nothing read them
    "rlvr-judge-without-a-route-that-calls-it": (["train", "--config", "@rlvr", "--set", "judge.model=notckpt", "--set",
                                                  "judge.engine.options={max_batch_size: 2}"],
                                                 ["judge.model, judge.engine.options are set, but no reward route "
                                                  "calls a model", "rewards: math -> math_rule",
                                                  "validation.rewards: mcq -> general_val_rule",
                                                  "remove them, or route a domain to the judge"]),
    "eval-rlvr-judge-without-a-route-that-calls-it": (["eval", "--config", "@rlvr", "--output", "out", "--set",
                                                       "judge.max_new_tokens=64"],
                                                      ["judge.max_new_tokens is set, but no reward route calls a "
                                                       "model"]),
    "rlvr-engine-window-below-sequence-length": (["train", "--config", "@rlvr", "--set", "engine.max_model_len=256"],
                                                 ["engine.max_model_len (256) must be >= sequence_length (512)",
                                                  "raise engine.max_model_len to 512 or leave it unset"]),
    "rlvr-budget-beyond-sequence-length": (["train", "--config", "@rlvr", "--set",
                                            "generating_args.max_new_tokens=512"],
                                           ["generating_args.max_new_tokens (512) must be below sequence_length (512)",
                                            "raise sequence_length or lower generating_args.max_new_tokens"]),
    "rlvr-difficulty-mask-on-groups-of-one": (["train", "--config", "@rlvr", "--set", "difficulty_mask=true", "--set",
                                               "num_return_sequences_in_group=1", "--set", "adv_estimator=reinforce"],
                                              ["difficulty_mask keeps a prompt's responses by the mean score",
                                               "set num_return_sequences_in_group: 8, or difficulty_mask: false"]),
    "rlvr-group-of-one": (["train", "--config", "@rlvr", "--set", "num_return_sequences_in_group=1"],
                          ["num_return_sequences_in_group (1) must be at least 2",
                           "set num_return_sequences_in_group: 8"]),
    "rlvr-validation-domain-without-route": (["train", "--config", "@rlvr", "--set",
                                              "validation.prompts.domains=[math]"],
                                             ["validation.prompts.domains ['math'] have no reward route",
                                              "add validation.rewards.routes"]),
    "rlvr-validation-unknown-worker": (["train", "--config", "@rlvr", "--set",
                                        "validation.rewards.routes.mcq.worker=nope"],
                                       ["validation.rewards.routes.mcq: unknown reward worker 'nope'"]),
}

EVAL = {
    "eval-config-missing": (["eval", "--config", "nope.yaml", "--output", "out"], ["nope.yaml does not exist"]),
    "eval-checkpoint-not-a-model": (["eval", "--config", "@quick", "--checkpoint", "notckpt", "--output", "out"],
                                    ["model folder notckpt has no config.json", "pass an HF-format checkpoint"]),
    "eval-checkpoint-missing": (["eval", "--config", "@quick", "--checkpoint", "nowhere", "--output", "out"],
                                ["model folder nowhere has no config.json"]),
    "eval-checkpoint-weights-cut-short": (["eval", "--config", "@quick", "--checkpoint", "@ckpt_weights_cut",
                                           "--output", "out"],
                                          ["model folder", "ckpt_weights_cut: model.safetensors holds",
                                           "bytes where its header says", "(cut short)",
                                           "restore the folder from a copy, or make it again"]),
    "eval-checkpoint-tokenizer-not-json": (["eval", "--config", "@quick", "--checkpoint", "@ckpt_tokenizer_not_json",
                                            "--output", "out"],
                                           ["ckpt_tokenizer_not_json: tokenizer.json is not valid JSON",
                                            "restore the folder from a copy"]),
    "eval-checkpoint-manifest-damaged": (["eval", "--config", "@quick", "--checkpoint", "@ckpt_manifest_not_json",
                                          "--output", "out"],
                                         ["ckpt_manifest_not_json/manifest.json is damaged", "it is not valid JSON"]),
    "eval-output-is-a-file": (["eval", "--config", "@quick", "--output", "afile"],
                              ["output", "afile is an existing file", "pass a folder"]),
    "eval-output-under-a-file": (["eval", "--config", "@quick", "--output", "afile/eval"],
                                 ["afile/eval lies under", "which is a file"]),
    "eval-set-unknown-key": (["eval", "--config", "@quick", "--output", "out", "--set", "eval.episodes=3"],
                             ["field 'eval.episodes'", "unknown option"]),
    "eval-unknown-env-type": (["eval", "--config", "@quick", "--output", "out", "--set", "rollout.env.tag=Go"],
                              ["rollout.env.tag 'Go' is not a registered environment"]),
    "eval-rlvr-unknown-validation-worker": (["eval", "--config", "@rlvr", "--output", "out", "--set",
                                             "validation.rewards.routes.mcq.worker=nope"],
                                            ["validation.rewards.routes.mcq: unknown reward worker 'nope'"]),
    # model folders an engine cannot load, found by reading their headers, config and tokenizer (issue 48); before,
    # they passed the file checks and failed about 45 s later inside the engine actor with a traceback
    "eval-checkpoint-weights-of-other-shapes": (["eval", "--config", "@quick", "--checkpoint", "@model_shapes",
                                                 "--output", "out"],
                                                ["model_shapes: tensor", "has shape [64, 16] in the weights but "
                                                 "[64, 32] in LlamaForCausalLM", "the weights belong to another model"]),
    "eval-checkpoint-of-another-architecture": (["eval", "--config", "@quick", "--checkpoint", "@model_gpt2",
                                                 "--output", "out"],
                                                ["model_gpt2: its weights are not those of the architecture its "
                                                 "config.json names", "of GPT2LMHeadModel are missing"]),
    "eval-checkpoint-without-tokenizer": (["eval", "--config", "@quick", "--checkpoint", "@model_no_tokenizer",
                                           "--output", "out"],
                                          ["model_no_tokenizer: its tokenizer does not load", "tokenizer.json"]),
    "eval-rlvr-validation-prompts-missing": (["eval", "--config", "@rlvr", "--output", "out", "--set",
                                              "validation.prompts.data_dir=emptydir"],
                                             ["validation.prompts:", "mcq.jsonl does not exist",
                                              "validation.prompts.domains must name JSONL files", "found: none"]),
}

ROLLOUT_CASES = {
    "rollout-checkpoint-without-tokenizer": (["rollout", "--config", "@rollout", "--checkpoint", "@model_no_tokenizer",
                                              "--output", "out"], ["its tokenizer does not load"]),
    "rollout-checkpoint-of-another-architecture": (["rollout", "--config", "@rollout", "--checkpoint", "@model_gpt2",
                                                    "--output", "out"],
                                                   ["are not those of the architecture its config.json names"]),
    "rollout-config-not-yaml": (["rollout", "--config", "notyaml.yaml", "--output", "out"], ["is not valid YAML"]),
    "rollout-unknown-env-type": (["rollout", "--config", "@rollout", "--output", "out", "--set", "env.tag=Chess"],
                                 ["env.tag 'Chess' is not a registered environment", "use one of:"]),
    "rollout-env-probability-out-of-range": (["rollout", "--config", "@rollout", "--output", "out", "--set",
                                              "env.env_config={p: 2.0}"],
                                             ["env.env_config", "p (P(frozen tile)) in (0, 1]", "p=2.0",
                                              "fix the env_config"]),
    "rollout-sokoban-room-too-small": (["rollout", "--config", "@rollout", "--output", "out", "--set",
                                        "env.tag=SimpleSokoban", "--set", "env.env_config={dim_room: [2, 2]}"],
                                       ["env.env_config", "dim_room=(H, W) with H, W >= 3"]),
    "rollout-env-needs-data": (["rollout", "--config", "@rollout", "--output", "out", "--set", "env.tag=GemQA"],
                               ["environment 'GemQA' needs data", "set env.env_config.data_path"]),
    "rollout-set-unknown-key": (["rollout", "--config", "@rollout", "--output", "out", "--set", "env.colour=red"],
                                ["field 'env.colour'", "unknown option"]),
    "rollout-bad-sample-level": (["rollout", "--config", "@rollout", "--output", "out", "--set",
                                  "sample_level=episode"], ["field 'sample_level'", "'step' or 'trajectory'"]),
    "rollout-unknown-engine": (["rollout", "--config", "@rollout", "--output", "out", "--set", "engine.backend=tgi"],
                               ["field 'engine.backend'", "'vllm' or 'hf'"]),
    "rollout-unknown-engine-dtype": (["rollout", "--config", "@rollout", "--output", "out", "--set",
                                      "engine.dtype=fp64"],
                                     ["field 'engine.dtype'", "'float32', 'bfloat16' or 'float16'"]),
    "rollout-unknown-engine-option": (["rollout", "--config", "@rollout", "--output", "out", "--set",
                                       "engine.options={bogus: 1}"],
                                      ["engine.options: 'bogus' is not an option of the 'vllm' generation backend",
                                       "which accepts only enforce_eager, kv_cache_space_gib", "engine_kwargs",
                                       "remove it or use one of those"]),
    "rollout-option-of-the-other-backend": (["rollout", "--config", "@rollout", "--output", "out", "--set",
                                             "engine.backend=hf"],
                                            ["engine.options: 'kv_cache_space_gib' is not an option of the 'hf' "
                                             "generation backend", "max_batch_size",
                                             "--set engine.options={} clears them"]),
    "rollout-engine-option-of-a-field": (["rollout", "--config", "@rollout", "--output", "out", "--set",
                                          "engine.options.dtype=float64"],
                                         ["field 'engine.options'", "'dtype' is passed to the backend from "
                                          "engine.dtype", "set engine.dtype instead"]),
    "rollout-unknown-vllm-engine-kwarg": (["rollout", "--config", "@rollout", "--output", "out", "--set",
                                           "engine.options.engine_kwargs={max_num_seq: 4}"],
                                          ["engine.options.engine_kwargs: 'max_num_seq' is not a keyword argument of "
                                           "vllm.LLM nor a field of vLLM's EngineArgs", "correct its name"]),
    "rollout-negative-temperature": (["rollout", "--config", "@rollout", "--output", "out", "--set",
                                      "generating_args.temperature=-1"],
                                     ["field 'generating_args.temperature'", "greater than or equal to 0"]),
    "rollout-empty-stop-string": (["rollout", "--config", "@rollout", "--output", "out", "--set",
                                   "generating_args.stop=['</answer>', '']"],
                                  ["field 'generating_args.stop'", "holds an empty string", "remove it"]),
    "rollout-bad-invalid-action-policy": (["rollout", "--config", "@rollout", "--output", "out", "--set",
                                           "on_invalid_action=explode"],
                                          ["field 'on_invalid_action'", "'continue' or 'end'"]),
    "rollout-output-is-a-file": (["rollout", "--config", "@rollout", "--output", "afile"],
                                 ["afile is an existing file", "pass a folder"]),
    "rollout-output-under-a-file": (["rollout", "--config", "@rollout", "--output", "afile/ro"],
                                    ["afile/ro lies under", "which is a file"]),
    "rollout-checkpoint-not-a-model": (["rollout", "--config", "@rollout", "--output", "out", "--checkpoint",
                                        "notckpt"], ["model folder notckpt has no config.json"]),
    "rollout-checkpoint-config-not-json": (["rollout", "--config", "@rollout", "--output", "out", "--checkpoint",
                                            "@ckpt_config_not_json"],
                                           ["ckpt_config_not_json: config.json is not valid JSON",
                                            "restore the folder from a copy"]),
    "rollout-checkpoint-without-weights": (["rollout", "--config", "@rollout", "--output", "out", "--checkpoint",
                                            "noweights"], ["model folder noweights has no *.safetensors weights"]),
}

SCORE = {
    # before: scored/ and samples/ were committed, then the chain blamed its own samples/ output
    "score-wrong-group-size": (["score", "--input", "@responses", "--config", "@score_config", "--output", "out",
                                "--advantages", "--set", "num_return_sequences_in_group=3"],
                               ["responses table at", "/responses: prompt_id", "has 8 responses, expected "
                                "num_return_sequences_in_group=3"]),
    "score-unknown-worker": (["score", "--input", "@responses", "--config", "@score_config", "--output", "out",
                              "--set", "rewards.routes.math.worker=nope"],
                             ["rewards.routes.math: unknown reward worker 'nope'", "registered:"]),
    "score-worker-bad-kwargs": (["score", "--input", "@responses", "--config", "@score_config", "--output", "out",
                                 "--set", "rewards.routes.math.kwargs={timeout: 5}"],
                                ["reward worker 'math_rule': bad kwargs ['timeout']", "see the worker's docstring"]),
    "score-custom-worker-not-importable": (["score", "--input", "@responses", "--config", "@score_config",
                                            "--output", "out", "--set", "rewards.routes.math.worker=nomod:Scorer"],
                                           ["cannot import module 'nomod'", "put it on PYTHONPATH"]),
    "score-domain-column-missing": (["score", "--input", "@responses", "--config", "@score_config", "--output",
                                     "out", "--set", "rewards.domain_column=subject"],
                                    ["rewards.domain_column 'subject' is not a column",
                                     "set rewards.domain_column to domain or tag"]),
    "score-domain-without-route": (["score", "--input", "@responses", "--config", "@score_config", "--output",
                                    "out", "--set", "rewards.routes={algebra: {worker: math_rule}}"],
                                   ["domain value(s) 'math' have no reward route",
                                    "add rewards.routes entries for them or a '*' fallback"]),
    "score-judge-backend": (["score", "--input", "@responses", "--config", "@score_config", "--output", "out",
                             "--judge-backend", "tgi"], ["--judge-backend 'tgi' must be vllm or hf"]),
    "score-judge-option-of-the-other-backend": (["score", "--input", "@responses", "--config", "@score_config",
                                                 "--output", "out", "--set", "rewards.routes.math={worker: llm_judge}",
                                                 "--set", "judge.engine.options={kv_cache_space_gib: 1}",
                                                 "--judge-backend", "hf"],
                                                ["judge.engine.options: 'kv_cache_space_gib' is not an option of "
                                                 "the 'hf' generation backend", "max_batch_size"]),
    "score-judge-window-below-its-sequence-length": (["score", "--input", "@responses", "--config", "@score_config",
                                                      "--output", "out", "--set", "judge.engine.max_model_len=512"],
                                                     ["judge.engine.max_model_len (512) must be >= "
                                                      "judge.sequence_length (2048)", "or leave it unset"]),
    "score-judge-options-without-a-judge-route": (["score", "--input", "@responses", "--config", "@score_config",
                                                   "--output", "out", "--set", "judge.engine.backend=hf"],
                                                  ["judge.engine.backend is set, but no reward route calls a model",
                                                   "rewards: math -> math_rule", "rewards.routes.<domain>: {worker: "
                                                   "llm_judge}"]),
    "score-judge-model-without-a-judge-route": (["score", "--input", "@responses", "--config", "@score_config",
                                                 "--output", "out", "--judge-model", "@model"],
                                                ["--judge-model is set, but no reward route calls a model"]),
    "score-output-under-a-file": (["score", "--input", "@responses", "--config", "@score_config", "--output",
                                   "afile/scores"], ["lies under", "which is a file", "pass a folder path"]),
    "score-response-null": (["score", "--input", "@null_response", "--config", "@score_config", "--output", "out"],
                            ["column 'response' is null in row 3", "every row needs a value"]),
    "score-response-not-text": (["score", "--input", "@binary_response", "--config", "@score_config", "--output",
                                 "out"], ["column 'response' has type binary, expected string"]),
}

FORWARD = {
    "logprobs-checkpoint-not-a-model": (["logprobs", "--samples", "@samples", "--checkpoint", "notckpt",
                                         "--output", "out"],
                                        ["checkpoint", "notckpt is not a Hugging Face model folder",
                                         "pass the default model folder or an earlier train-step output"]),
    "logprobs-reference-not-a-model": (["logprobs", "--samples", "@samples", "--checkpoint", "@model",
                                        "--reference", "noweights", "--output", "out"],
                                       ["noweights is not a Hugging Face model folder"]),
    "logprobs-set-unknown-key": (["logprobs", "--samples", "@samples", "--checkpoint", "@model", "--output",
                                  "out", "--set", "threadz=2"], ["field 'threadz'", "unknown option"]),
    "values-checkpoint-missing": (["values", "--samples", "@samples", "--checkpoint", "nowhere", "--output", "out"],
                                  ["nowhere is not a Hugging Face model folder"]),
    "train-step-checkpoint-not-a-model": (["train-step", "--samples", "@advantaged", "--checkpoint", "emptydir",
                                           "--output", "out"], ["emptydir is not a Hugging Face model folder"]),
    "train-step-train-state-not-json": (["train-step", "--samples", "@advantaged", "--checkpoint",
                                         "@ckpt_train_state_not_json", "--output", "out"],
                                        ["ckpt_train_state_not_json: train_state.json is not valid JSON",
                                         "restore the folder from a copy"]),
    "train-step-train-state-field-of-wrong-type": (["train-step", "--samples", "@advantaged", "--checkpoint",
                                                    "@ckpt_step_text", "--output", "out"],
                                                   ["ckpt_step_text: train_state.json field 'global_step' is a "
                                                    "string, expected an integer"]),
    "train-step-deepspeed-state-cut-short": (["train-step", "--samples", "@advantaged", "--checkpoint",
                                              "@ckpt_state_cut", "--output", "out"],
                                             ["ckpt_state_cut: deepspeed/actor/state/mp_rank_00_model_states.pt is not "
                                              "a whole torch file"]),
    "logprobs-checkpoint-weights-cut-short": (["logprobs", "--samples", "@samples", "--checkpoint",
                                               "@ckpt_weights_cut", "--output", "out"],
                                              ["ckpt_weights_cut: model.safetensors holds", "(cut short)"]),
    "logprobs-reference-shard-missing": (["logprobs", "--samples", "@samples", "--checkpoint", "@model",
                                          "--reference", "@ckpt_shard_missing", "--output", "out"],
                                         ["ckpt_shard_missing: model.safetensors.index.json lists the shard "
                                          "model-00002-of-00002.safetensors, which is missing"]),
    "values-checkpoint-manifest-damaged": (["values", "--samples", "@samples", "--checkpoint",
                                            "@ckpt_manifest_not_json", "--output", "out"],
                                           ["ckpt_manifest_not_json/manifest.json is damaged"]),
    "train-step-difficulty-weight-without-the-column": (["train-step", "--samples", "@advantaged", "--checkpoint",
                                                        "@model", "--output", "out", "--set", "policy_loss=rlvr",
                                                        "--set", "difficulty_loss_weight=true"],
                                                       ["advantaged table at", "missing column 'difficulty'"]),
    "train-step-config-not-yaml": (["train-step", "--samples", "@advantaged", "--checkpoint", "@model",
                                    "--config", "notyaml.yaml", "--output", "out"], ["is not valid YAML"]),
}

STAGE = {
    "stage-unknown": (["stage", "nostage", "--from", "stage_ok"],
                      ["unknown stage 'nostage'", "rollflow stage re-runs response_rewards, advantages",
                       "rollflow train --config FILE"]),
    "stage-from-a-plain-folder": (["stage", "advantages", "--from", "emptydir"],
                                  ["emptydir is not an output of stage advantages", "pass the folder the stage wrote"]),
    "stage-from-another-stages-output": (["stage", "response_rewards", "--from", "stage_ok"],
                                         ["stage_ok is not an output of stage response_rewards"]),
    "stage-set-unknown-key": (["stage", "advantages", "--from", "stage_ok", "--set", "adv_estimater=grpo"],
                              ["field 'adv_estimater'", "unknown option"]),
    "stage-set-not-yaml": (["stage", "advantages", "--from", "stage_ok", "--set", "gamma=[1"],
                           ["override 'gamma=[1'", "is not valid YAML"]),
    "stage-set-invalid-value": (["stage", "advantages", "--from", "stage_ok", "--set", "gamma=2"],
                                ["field 'gamma'", "less than or equal to 1"]),
    "stage-recorded-input-gone": (["stage", "advantages", "--from", "stage_out"],
                                  ["input 'samples' of", "no longer exists", "restore it, or re-run"]),
    "stage-rollout-turn-from-another-stages-output": (["stage", "rollout_turn", "--from", "stage_ok"],
                                                      ["stage_ok is not an output of stage rollout_turn",
                                                       "pass a rollout's turn folder",
                                                       "runs/<run>/iter_0000/rollout/turns/turn_001"]),
    "stage-checkpoint-not-a-rollout": (["stage", "advantages", "--from", "stage_ok", "--checkpoint", "emptydir"],
                                       ["--checkpoint is for a rollout replay (rollout_turn, rollout_reset)",
                                        "leave --checkpoint out"]),
    "stage-train-step-checkpoint-damaged": (["stage", "train_step", "--from", "@train_step_out"],
                                            ["ckpt_config_not_json: config.json is not valid JSON",
                                             "restore the folder from a copy"]),
    "stage-eval-checkpoint-damaged": (["stage", "eval", "--from", "@eval_out"],
                                      ["ckpt_weights_cut: model.safetensors holds", "(cut short)"]),
    "stage-output-is-a-file": (["stage", "advantages", "--from", "stage_ok", "--set", "gamma=0.9", "--output",
                                "afile"], ["afile is an existing file", "pass a folder"]),
}

FOLDERS = {
    "lineage-missing": (["lineage", "nowhere"], ["nowhere is not a folder", "pass a run folder or a stage output"]),
    "lineage-a-file": (["lineage", "afile"], ["afile is not a folder"]),
    "lineage-no-stage-output": (["lineage", "emptydir"], ["emptydir holds no stage output",
                                                          "pass a run folder (runs/<run>) or a folder a stage wrote"]),
    "report-missing": (["report", "nowhere"], ["run folder nowhere does not exist", "pass a run folder"]),
    "report-a-file": (["report", "afile"], ["run folder afile is a file, not a folder"]),
    "report-not-a-run": (["report", "emptydir"], ["emptydir is not a run folder", "neither config.json nor metrics/",
                                                  "pass the folder of a run started by `rollflow train`"]),
    "report-turn-part-corrupt": (["report", "run_bad_turn"], ["turn table input file", "run_bad_turn/iter_0000/"
                                                              "rollout/turns/turn_000/part-00000.parquet is not a "
                                                              "readable Parquet file", "re-run that stage"]),
    "report-folder-is-a-file": (["report", "run_report_file"], ["report: run_report_file/report is a file",
                                                                 "move the file away, or pass --output DIR"]),
    "report-metrics-is-a-file": (["report", "run_metrics_file"], ["metrics table", "run_metrics_file/metrics is a "
                                                                   "file, where a run keeps its metrics",
                                                                   "move the file out of the run folder"]),
    "inspect-missing": (["inspect", "nowhere"], ["nowhere does not exist or is not a folder",
                                                 "pass the folder that holds the Parquet files"]),
    "inspect-a-file": (["inspect", "afile"], ["afile does not exist or is not a folder"]),
    "validate-no-parquet": (["validate", "emptydir"], ["emptydir holds no .parquet files",
                                                       "rollflow example --output DIR"]),
    "show-not-a-rollout": (["show", "emptydir"], ["holds no rollout (no episodes/ folder)",
                                                  "pass the --output folder of rollflow rollout"]),
    "show-episodes-part-corrupt": (["show", "rollout_bad"], ["rollout table input file",
                                                             "rollout_bad/episodes/part-00000.parquet is not a readable "
                                                             "Parquet file", "re-run that stage"]),
    "inspect-manifest-not-an-object": (["inspect", "@manifest_list"],
                                       ["manifest_list/manifest.json is damaged", "holds a list, not a JSON object",
                                        "delete the folder", "re-run the stage that produced it"]),
    "inspect-manifest-a-folder": (["inspect", "@manifest_folder"], ["manifest_folder/manifest.json is damaged",
                                                                   "it is not a file"]),
    "inspect-manifest-not-utf8": (["inspect", "@manifest_binary"], ["manifest_binary/manifest.json is damaged",
                                                                    "it is not valid JSON"]),
    "inspect-manifest-metric-not-a-number": (["inspect", "@manifest_metric_text"],
                                             ["manifest_metric_text/manifest.json is damaged",
                                              "metric 'loss' is a string, expected a number"]),
    "validate-manifest-field-of-wrong-type": (["validate", "@manifest_rows_text"],
                                              ["manifest_rows_text/manifest.json is damaged",
                                               "field 'rows' is a string, expected an integer"]),
    "validate-manifest-group-size-of-wrong-type": (["validate", "@manifest_group_size_text"],
                                                   ["manifest_group_size_text/manifest.json is damaged",
                                                    "field 'params.group_size' is a string, expected an integer",
                                                    "re-run the stage that produced it"]),
    "lineage-manifest-input-without-path": (["lineage", "@manifest_input_no_path"],
                                            ["manifest_input_no_path/manifest.json is damaged",
                                             "input 'samples' is not an object with a string 'path'"]),
    "stage-manifest-not-an-object": (["stage", "advantages", "--from", "@manifest_list"],
                                     ["manifest_list/manifest.json is damaged", "holds a list"]),
    "inspect-part-listed-but-missing": (["inspect", "@part_missing"],
                                        ["part_missing/part-00000.parquet is listed in its manifest but missing",
                                         "restore it from the stage that wrote it or re-run that stage"]),
    "validate-part-not-listed": (["validate", "@part_unlisted"],
                                 ["part_unlisted/part-00007.parquet is not one of the files its manifest lists",
                                  "move it out of the folder or re-run that stage"]),
    "recompute-part-not-listed": (["recompute", "--input", "@part_unlisted", "--config", "@gigpo", "--output", "out"],
                                  ["part-00007.parquet is not one of the files its manifest lists"]),
    "validate-part-replaced": (["validate", "@part_replaced"], ["part_replaced/part-00000.parquet holds 5 rows where "
                                                                "the manifest of", "lists", "it was replaced"]),
    "lineage-manifest-input-without-fingerprint": (["lineage", "@manifest_input_no_fingerprint"],
                                                   ["manifest_input_no_fingerprint/manifest.json is damaged",
                                                    "input 'samples' records no fingerprint"]),
    "lineage-input-manifest-without-fingerprint": (["lineage", "@reads_no_fingerprint"],
                                                   ["manifest_no_fingerprint/manifest.json is damaged",
                                                    "it has no field 'fingerprint'", "re-run the stage"]),
    "stage-manifest-without-state-in": (["stage", "advantages", "--from", "stage_no_state"],
                                        ["stage_no_state/manifest.json is damaged", "it has no field 'state_in'",
                                         "re-run the stage that produced it"]),
    "stage-downstream-manifest-without-section": (["stage", "advantages", "--from", "chain/first", "--downstream"],
                                                  ["chain/reader/manifest.json is damaged",
                                                   "it has no field 'section'"]),
    "stage-rollout-turn-without-previous": (["stage", "rollout_turn", "--from", "ro_turn/turns/turn_001"],
                                            ["ro_turn/turns/turn_001/manifest.json is damaged",
                                             "it records no input 'previous'"]),
    "stage-manifest-without-section": (["stage", "advantages", "--from", "@manifest_no_section"],
                                       ["manifest_no_section/manifest.json is damaged",
                                        "it has no field 'section'"]),
}

TOOLS = {
    "example-unknown-env": (["example", "--output", "ex", "--env", "chess"],
                            ["--env 'chess'", "--env must be frozenlake or sokoban"]),
    "example-output-exists": (["example", "--output", "emptydir", "--samples", "16"],
                              ["emptydir already exists", "choose a new --output folder or delete it first"]),
    "example-response-range": (["example", "--output", "ex", "--min-response", "50", "--max-response", "10"],
                               ["response_len (50, 10) must satisfy 0 <= min <= max"]),
    "rlvr-example-unknown-domain": (["rlvr-example", "--output", "rx", "--domains", "chemistry"],
                                    ["unknown example domain 'chemistry'", "choose from math, code, mcq, ifeval"]),
    "rlvr-example-output-exists": (["rlvr-example", "--output", "afile", "--limit", "1"],
                                   ["afile already exists", "choose a new --output folder"]),
    "demo-run-dir-under-a-file": (["demo", "--run-dir", "afile/demo"], ["/afile/demo lies under", "/afile, which is a "
                                                                        "file; pass a folder path"]),
    "demo-config-missing": (["demo", "--run-dir", "demo", "--config", "nope.yaml"], ["nope.yaml does not exist"]),
    "deploy-unknown-flow": (["deploy", "--flow", "rollout"], ["--flow 'rollout' is not deployable",
                                                              "choose one of ['recompute', 'train']"]),
    "deploy-bad-cron": (["deploy", "--cron", "every day", "--input", "emptydir", "--output", "out"],
                        ["--cron 'every day' is not a valid cron schedule", "use 5 fields"]),
    "deploy-bad-timezone": (["deploy", "--cron", "0 3 * * *", "--timezone", "Mars/Base", "--input", "emptydir",
                             "--output", "out"], ["--timezone 'Mars/Base' is not a time zone name",
                                                  "use an IANA name such as UTC"]),
    "deploy-no-schedule": (["deploy", "--input", "emptydir", "--output", "out"],
                           ["give exactly one schedule", "--interval SECONDS"]),
    "deploy-no-server": (["deploy", "--interval", "60", "--input", "emptydir", "--output", "out"],
                         ["no Prefect server given", "start one with `rollflow server`"]),
    "server-home-is-a-file": (["server", "--home", "afile", "--port", "@port", "--timeout", "5"],
                              ["home", "afile is a file", "pass a folder"]),
}

# config files that are not a YAML mapping of options of the command (issue 48): refused when the file is read, by
# every command alike (schemas/config.py read_config_file, other_command_config), before Ray, Prefect or a folder
CONFIG_FILES = {
    "train-config-is-a-folder": (["train", "--config", "emptydir"], ["config file emptydir is a folder",
                                                                     "pass a YAML file"]),
    "plan-config-not-utf8": (["plan", "--config", "latin1.yaml"], ["latin1.yaml is not UTF-8 text (byte 0xe9",
                                                                   "save it as UTF-8"]),
    "train-config-empty": (["train", "--config", "empty.yaml"], ["empty.yaml holds no options",
                                                                 "leave out --config to use the defaults"]),
    "rollout-config-only-comments": (["rollout", "--config", "comments.yaml", "--output", "out"],
                                     ["comments.yaml holds no options (it is empty or only comments)"]),
    "score-config-empty": (["score", "--input", "@responses", "--config", "empty.yaml", "--output", "out"],
                           ["empty.yaml holds no options"]),
    "logprobs-config-is-a-folder": (["logprobs", "--samples", "@samples", "--checkpoint", "@model", "--config",
                                     "emptydir", "--output", "out"], ["config file emptydir is a folder"]),
    "train-config-of-rollout": (["train", "--config", "@rollout"],
                                ["is a config of rollflow rollout (episodes played by a policy)",
                                 "are not options of rollflow train, plan or eval", "use it with rollflow rollout"]),
    "score-config-of-recompute": (["score", "--input", "@responses", "--config", "@gigpo", "--output", "out"],
                                  ["is a config of rollflow recompute", "use it with rollflow recompute",
                                   "or pass a config of rollflow score (configs/rlvr_math.yaml)"]),
    "rollout-config-of-train": (["rollout", "--config", "@quick", "--output", "out"],
                                ["is a config of rollflow train, plan or eval (an agentic training run)"]),
    "train-step-config-of-score": (["train-step", "--samples", "@advantaged", "--checkpoint", "@model", "--config",
                                    "@score_config", "--output", "out"],
                                   ["is a config of rollflow score", "not options of rollflow train-step"]),
    "eval-config-of-score": (["eval", "--config", "@score_config", "--output", "out"],
                             ["is a config of rollflow score", "use it with rollflow score"]),
    "deploy-config-of-rlvr-training": (["deploy", "--interval", "60", "--input", "emptydir", "--output", "out",
                                        "--config", "@rlvr"],
                                       ["is a config of rollflow train, plan or eval with pipeline: rlvr",
                                        "not options of rollflow recompute"]),
    "demo-config-empty": (["demo", "--run-dir", "demo", "--config", "empty.yaml"], ["empty.yaml holds no options"]),
}

# Click's own refusals print its usage box, not rollflow's "error:" line
USAGE = {
    "train-unknown-option": (["train", "--confg", "x.yaml"], ["No such option: --confg", "--config"]),
    "eval-missing-output": (["eval", "--config", "@quick"], ["Missing option '--output'"]),
    "plan-missing-config": (["plan", "--cpus", "2"], ["Missing option '--config'"]),
    "rollout-missing-output": (["rollout", "--config", "@rollout"], ["Missing option '--output'"]),
    "score-missing-input": (["score", "--config", "@score_config", "--output", "out"], ["Missing option '--input'"]),
    # every numeric option has its bounds (test_every_numeric_option_states_its_bounds); before, --group-size 0
    # skipped the check and said OK, a negative one blamed the data, show -n -1 showed all but the last episode
    "validate-group-size-zero": (["validate", "@samples", "--group-size", "0"],
                                 ["Invalid value for '--group-size'", "greater than or equal to 1"]),
    "validate-group-size-negative": (["validate", "@samples", "--group-size", "-8"],
                                     ["Invalid value for '--group-size'"]),
    "show-negative-episodes": (["show", "emptydir", "-n", "-1"], ["Invalid value for '--episodes'"]),
    "show-zero-text": (["show", "emptydir", "--max-text", "0"], ["Invalid value for '--max-text'"]),
    "example-zero-samples": (["example", "--output", "ex", "--samples", "0"], ["Invalid value for '--samples'"]),
    "example-negative-seed": (["example", "--output", "ex", "--seed", "-1"], ["Invalid value for '--seed'"]),
    "rlvr-example-zero-samples": (["rlvr-example", "--output", "rx", "--samples-per-prompt", "0"],
                                  ["Invalid value for '--samples-per-prompt'"]),
    "rlvr-example-zero-limit": (["rlvr-example", "--output", "rx", "--limit", "0"], ["Invalid value for '--limit'"]),
    "report-negative-episodes": (["report", "emptydir", "--episodes", "-2"], ["Invalid value for '--episodes'"]),
    "server-port-out-of-range": (["server", "--port", "70000"], ["Invalid value for '--port'",
                                                                 "less than or equal to 65535"]),
    "server-zero-timeout": (["server", "--timeout", "0"], ["Invalid value for '--timeout'"]),
    "deploy-zero-interval": (["deploy", "--interval", "0", "--input", "emptydir", "--output", "out"],
                             ["Invalid value for '--interval'"]),
    "plan-negative-cpus": (["plan", "--config", "@quick", "--cpus", "-1"], ["Invalid value for '--cpus'"]),
    "example-samples-not-a-number": (["example", "--output", "ex", "--samples", "many"],
                                     ["Invalid value for '--samples'", "valid integer"]),
}

CATALOGUE = {**CONFIG_FILES, **TRAIN, **PLAN, **RLVR, **EVAL, **ROLLOUT_CASES, **SCORE, **FORWARD, **STAGE, **FOLDERS, **TOOLS}


@pytest.fixture
def no_services(monkeypatch):
    """Ray and Prefect cannot start: a bad input must be refused before either (the pre-flight's promise)."""
    import flows.services
    import stages.cluster

    def refuse(*args, **kwargs):
        raise AssertionError("the pre-flight let a bad input through to Ray/Prefect")

    monkeypatch.setattr(stages.cluster, "ensure_ray", refuse)
    monkeypatch.setattr(flows.services, "start_services", refuse)


@pytest.fixture(scope="module")
def shared(tmp_path_factory, data_root, tiny_model) -> dict[str, str]:
    """Read-only inputs the cases name: a responses table (and two with unreadable model output), a samples table,
    an advantaged table, the tiny model."""
    from stages.rlvr.example import RLVRExampleSpec, write_rlvr_example

    root = tmp_path_factory.mktemp("catalogue")
    responses = root / "responses"
    write_rlvr_example(RLVRExampleSpec(domains=("math",), n=8, limit=2), str(responses))
    table = read_table(responses)
    samples = data_root / "catalogue_samples"
    if not samples.exists():  # made once a session (tests/spine/test_data_loss.py uses this fixture too)
        generate(ExampleSpec(samples=16, seed=4, rows_per_file=1000, **SMALL), str(samples))
    return {
        "responses": str(responses),
        "null_response": write_samples(replace_value(table, "response", 3, None), root / "null_response"),
        "binary_response": write_samples(set_column(table, "response", [s.encode() for s in
                                                                        table.column("response").to_pylist()],
                                                    pa.binary()), root / "binary_response"),
        "samples": str(samples),
        **_damaged_manifests(samples, root), **_damaged_parts(samples, root),
        "advantaged": write_samples(_advantaged(read_table(samples)), root / "advantaged"),
        **_damaged_checkpoints(root), **_mismatched_models(root, tiny_model),
        "model": str(tiny_model),
        "quick": QUICK, "h100": H100, "gigpo": GIGPO, "rlvr": RLVR_TRAIN, "rollout": ROLLOUT, "score_config": RLVR_SCORE,
    }


def _damaged_manifests(samples: Path, root: Path) -> dict[str, str]:
    """Copies of the samples table whose manifest.json is damaged, by name."""
    import shutil

    manifest = json.loads((samples / "manifest.json").read_text())
    texts = {"manifest_list": "[1, 2]", "manifest_binary": b"\xff\xfe{}",
             "manifest_rows_text": json.dumps({**manifest, "rows": "many"}),
             "manifest_metric_text": json.dumps({**manifest, "metrics": {"loss": "low"}}),
             "manifest_group_size_text": json.dumps({**manifest, "params": {**manifest["params"],
                                                                             "group_size": "eight"}}),
             "manifest_input_no_path": json.dumps({**manifest, "inputs": {"samples": {"fingerprint": "0" * 64}}}),
             "manifest_input_no_fingerprint": json.dumps({**manifest, "inputs": {"samples": {"path": str(samples)}}}),
             "manifest_no_fingerprint": json.dumps({k: v for k, v in manifest.items() if k != "fingerprint"}),
             "reads_no_fingerprint": json.dumps({**manifest, "inputs": {"samples": {
                 "path": str(root / "manifest_no_fingerprint"), "fingerprint": "0" * 64}}}),
             "manifest_no_section": json.dumps({**manifest, "stage": "advantages", "inputs": {}}),
             "manifest_folder": None}
    for name, text in texts.items():
        shutil.copytree(samples, root / name)
        target = root / name / "manifest.json"
        target.unlink()
        if text is None:
            target.mkdir()
        else:
            target.write_bytes(text if isinstance(text, bytes) else text.encode())
    return {name: str(root / name) for name in texts}


def _damaged_parts(samples: Path, root: Path) -> dict[str, str]:
    """Copies of the samples table (one part file) whose files are not those its manifest lists, by name."""
    import shutil

    import pyarrow.parquet as pq

    copies = {name: root / name for name in ("part_missing", "part_unlisted", "part_replaced")}
    for folder in copies.values():
        shutil.copytree(samples, folder)
    (copies["part_missing"] / "part-00000.parquet").unlink()
    shutil.copy(samples / "part-00000.parquet", copies["part_unlisted"] / "part-00007.parquet")
    pq.write_table(read_table(samples).slice(0, 5), copies["part_replaced"] / "part-00000.parquet")
    return {name: str(folder) for name, folder in copies.items()}


def _small_checkpoint(folder: Path) -> Path:
    """A run checkpoint's files in small (weights of one tensor): what the pre-flight reads of a model folder."""
    import zipfile

    import numpy as np
    from safetensors.numpy import save_file

    (folder / "deepspeed/actor/state").mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (folder / "tokenizer.json").write_text(json.dumps({"version": "1.0"}))
    save_file({"w": np.zeros(4, np.float32)}, str(folder / "model.safetensors"))
    (folder / "train_state.json").write_text(json.dumps({"global_step": 1, "optimizer_steps": 1, "world_size": 1}))
    with zipfile.ZipFile(folder / "deepspeed/actor/state/mp_rank_00_model_states.pt", "w") as state:
        state.writestr("archive/data.pkl", b"x" * 64)
    (folder / "manifest.json").write_text(json.dumps({"stage": "train_step", "fingerprint": "0" * 64}))
    return folder


# a damaged copy of a small checkpoint -> (its file, the new contents)
CHECKPOINT_DAMAGES = {"ckpt_weights_cut": ("model.safetensors", None),  # cut short by 4 bytes
                      "ckpt_config_not_json": ("config.json", b'{"model_type": '),
                      "ckpt_tokenizer_not_json": ("tokenizer.json", b'{"version'),
                      "ckpt_train_state_not_json": ("train_state.json", b'{"global_step": 1,'),
                      "ckpt_step_text": ("train_state.json", b'{"global_step": "one"}'),
                      "ckpt_manifest_not_json": ("manifest.json", b'{"stage": "train'),
                      "ckpt_state_cut": ("deepspeed/actor/state/mp_rank_00_model_states.pt", b"PK\x03\x04 cut"),
                      "ckpt_shard_missing": ("model.safetensors.index.json",
                                             b'{"weight_map": {"w": "model-00002-of-00002.safetensors"}}')}


def _mismatched_models(root: Path, tiny: Path) -> dict[str, str]:
    """Small whole model folders (a one-layer llama, zero weights) whose files pass stages/model_files.py but that
    an engine cannot load: weights of other shapes than config.json says (model_shapes), config.json of another
    architecture (model_gpt2), no tokenizer (model_no_tokenizer)."""
    import numpy as np
    import torch
    import transformers
    from safetensors.numpy import save_file

    small = {**json.loads((tiny / "config.json").read_text()), "vocab_size": 64, "hidden_size": 16,
             "intermediate_size": 32, "head_dim": 8, "num_hidden_layers": 1}
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**small))
    weights = {n: np.zeros(tuple(t.shape), np.float32) for n, t in model.state_dict().items() if n != "lm_head.weight"}
    configs = {"model_shapes": {**small, "hidden_size": 32, "head_dim": 16},
               "model_gpt2": {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 16, "n_layer": 1,
                              "n_head": 2, "vocab_size": 64},
               "model_no_tokenizer": small}
    for name, cfg in configs.items():
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(cfg))
        save_file(weights, str(root / name / "model.safetensors"))
        if name != "model_no_tokenizer":
            for file in ("tokenizer.json", "tokenizer_config.json"):
                (root / name / file).write_bytes((tiny / file).read_bytes())
    return {name: str(root / name) for name in configs}


def _replaying_run(run: Path, frozen) -> None:
    """A run folder (its config ``frozen``) whose newest checkpoint, iter_0001's, holds weights only and replays from
    iter_0000's, whose DeepSpeed state file is cut short."""
    import shutil

    origin = _small_checkpoint(run / "iter_0000" / "checkpoint")
    (origin / "deepspeed/actor/state/mp_rank_00_model_states.pt").write_bytes(b"PK\x03\x04 cut")
    newest = _small_checkpoint(run / "iter_0001" / "checkpoint")
    shutil.rmtree(newest / "deepspeed")
    replay = {"from": str(origin), "steps": [{"samples": str(run), "fingerprint": "f", "section": {}}]}
    (newest / "train_state.json").write_text(json.dumps({"global_step": 2, "replay": replay}))
    (run / "config.json").write_text(json.dumps(frozen.model_dump(mode="json")))


def _damaged_checkpoints(root: Path) -> dict[str, str]:
    """Small checkpoints with one file damaged (:data:`CHECKPOINT_DAMAGES`), and stage outputs whose recorded
    checkpoint is one: a training step's (train_step_out) and an evaluation's (eval_out)."""
    from schemas.config import load_config_data, validate_config
    from schemas.train_config import TrainSection
    from schemas.train_flow_config import TrainFlowConfig

    folders = {}
    for name, (file, text) in CHECKPOINT_DAMAGES.items():
        target = _small_checkpoint(root / name) / file
        target.write_bytes(text if text is not None else target.read_bytes()[:-4])
        folders[name] = str(root / name)
    quick = validate_config(TrainFlowConfig, load_config_data(QUICK, {}), QUICK)
    outputs = {"train_step_out": ("train_step", validate_config(TrainSection, {}, "train"),
                                  {"checkpoint": folders["ckpt_config_not_json"], "samples": str(root)}),
               "eval_out": ("eval", quick.eval_rollout(), {"checkpoint": folders["ckpt_weights_cut"]})}
    for name, (stage, section, inputs) in outputs.items():
        (root / name).mkdir()
        manifest = {"stage": stage, "section": section.model_dump(mode="json"), "state_in": {},
                    "inputs": {key: {"path": path} for key, path in inputs.items()}}
        (root / name / "manifest.json").write_text(json.dumps(manifest))
        folders[name] = str(root / name)
    return folders


def _fake_stage_output(folder: Path, inputs: dict[str, str]) -> None:
    """An advantages output as far as ``rollflow stage`` reads it before Ray: its manifest (section and inputs)."""
    from schemas.config import AdvantageSection, section

    folder.mkdir()
    manifest = {"stage": "advantages", "section": section(config(GIGPO), AdvantageSection).model_dump(mode="json"),
                "inputs": {name: {"path": path} for name, path in inputs.items()}, "state_in": {}}
    (folder / "manifest.json").write_text(json.dumps(manifest))


@pytest.fixture
def work(tmp_path, monkeypatch, no_services) -> Path:
    """The working folder of one case (the current directory): the bad paths and states the cases name."""
    from schemas.config import load_config_data, validate_config
    from schemas.train_flow_config import TrainFlowConfig

    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("keep me\n")
    for name in ("emptydir", "notckpt", "noweights"):
        (tmp_path / name).mkdir()
    (tmp_path / "notckpt" / "README.md").write_text("not a model\n")
    (tmp_path / "noweights" / "config.json").write_text("{}\n")
    (tmp_path / "notyaml.yaml").write_text("run_name: [quickstart\n")
    (tmp_path / "list.yaml").write_text("- run_name\n- max_steps\n")
    (tmp_path / "latin1.yaml").write_bytes("run_name: caf\u00e9\n".encode("latin-1"))
    (tmp_path / "empty.yaml").write_bytes(b"")
    (tmp_path / "comments.yaml").write_text("# the options go here\n")
    good = '{"id": "p1", "prompt": "1+1?", "ground_truth": "2"}\n'
    for folder, text in (("prompts_empty", b"\n"), ("prompts_field", (good + '{"id": "p2", "prompt": "2+2?"}\n').encode()),
                         ("prompts_list", b'["p1", "1+1?", "2"]\n'),
                         ("prompts_latin1", '{"id": "p1", "prompt": "caf\u00e9?", "ground_truth": "2"}\n'.encode(
                             "latin-1"))):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "math.jsonl").write_bytes(text)
    other = load_config_data(QUICK, {"runs_dir": "other_runs", "rollout.seed": 8})
    frozen = validate_config(TrainFlowConfig, other, "other").model_dump(mode="json")
    (tmp_path / "other_runs" / "quickstart").mkdir(parents=True)
    (tmp_path / "other_runs" / "quickstart" / "config.json").write_text(json.dumps(frozen))
    resumable = validate_config(TrainFlowConfig, load_config_data(QUICK, {"runs_dir": "ckpt_runs"}), "ckpt_runs")
    (tmp_path / "ckpt_runs" / "quickstart" / "iter_0000").mkdir(parents=True)
    (tmp_path / "ckpt_runs" / "quickstart" / "config.json").write_text(json.dumps(resumable.model_dump(mode="json")))
    state = _small_checkpoint(tmp_path / "ckpt_runs" / "quickstart" / "iter_0000" / "checkpoint") / "train_state.json"
    state.write_text('{"global_step": 1,')
    _replaying_run(tmp_path / "replay_runs" / "quickstart", validate_config(
        TrainFlowConfig, load_config_data(QUICK, {"runs_dir": "replay_runs"}), "replay_runs"))
    (tmp_path / "moved_runs" / "quickstart").mkdir(parents=True)
    (tmp_path / "moved_runs" / "quickstart" / "config.json").write_text(json.dumps(frozen))
    (tmp_path / "rollout_bad" / "episodes").mkdir(parents=True)
    (tmp_path / "rollout_bad" / "episodes" / "part-00000.parquet").write_bytes(b"PAR1 cut short")
    (tmp_path / "run_bad_turn" / "metrics").mkdir(parents=True)
    (tmp_path / "run_bad_turn" / "iter_0000" / "rollout" / "turns" / "turn_000").mkdir(parents=True)
    (tmp_path / "run_bad_turn" / "iter_0000" / "rollout" / "turns" / "turn_000" / "part-00000.parquet").write_bytes(
        b"PAR1 cut short")
    (tmp_path / "run_report_file" / "metrics").mkdir(parents=True)
    (tmp_path / "run_report_file" / "report").write_text("not the report\n")
    (tmp_path / "run_metrics_file").mkdir()
    (tmp_path / "run_metrics_file" / "config.json").write_text("{}\n")
    (tmp_path / "run_metrics_file" / "metrics").write_text("not the metrics\n")
    for runs, text in (("damaged_runs", '{"run_name": "quick'), ("list_runs", "[1]")):
        (tmp_path / runs / "quickstart").mkdir(parents=True)
        (tmp_path / runs / "quickstart" / "config.json").write_text(text)
    _fake_stage_output(tmp_path / "stage_out", {"samples": str(tmp_path / "gone"), "rewarded": str(tmp_path / "gone")})
    _fake_stage_output(tmp_path / "stage_no_state", {"samples": str(tmp_path / "emptydir"),
                                                     "rewarded": str(tmp_path / "emptydir")})
    manifest = json.loads((tmp_path / "stage_no_state" / "manifest.json").read_text())
    manifest.pop("state_in")
    (tmp_path / "stage_no_state" / "manifest.json").write_text(json.dumps(manifest))
    _fake_stage_output(tmp_path / "stage_ok", {"samples": str(tmp_path / "emptydir"),
                                               "rewarded": str(tmp_path / "emptydir")})
    (tmp_path / "chain").mkdir()
    _fake_stage_output(tmp_path / "chain" / "first", {"samples": str(tmp_path / "emptydir"),
                                                      "rewarded": str(tmp_path / "emptydir")})
    _fake_stage_output(tmp_path / "chain" / "reader", {"samples": str(tmp_path / "chain" / "first"),
                                                       "rewarded": str(tmp_path / "emptydir")})
    manifest = json.loads((tmp_path / "chain" / "reader" / "manifest.json").read_text())
    manifest.pop("section")
    (tmp_path / "chain" / "reader" / "manifest.json").write_text(json.dumps(manifest))
    (tmp_path / "ro_turn" / "turns" / "turn_001").mkdir(parents=True)
    (tmp_path / "ro_turn" / "turns" / "turn_001" / "manifest.json").write_text(json.dumps(
        {"stage": "rollout_turn", "inputs": {}, "state_in": {"turn": 1}}))
    return tmp_path


def _argv(argv: list[str], shared: dict[str, str]) -> list[str]:
    from stages.ports import free_port

    values = {**shared, "port": str(free_port())}
    return [values[a[1:]] if a.startswith("@") else a for a in argv]


def _shared_digests(shared: dict[str, str]) -> dict:
    """The state of every shared input folder (size, inode and times of each file: stages/model_files.py
    ``file_states``; they were made before the first case, longer ago than the file system's time granularity, so a
    case that writes, replaces or touches a file changes its ctime). Hashing their bytes after each case, the tiny
    model and the mismatched and damaged model folders among them, cost 8.7 CPU-s a module."""
    return {k: file_states(v) for k, v in shared.items() if Path(v).is_dir()}


def _digests(work: Path, shared: dict[str, str]) -> dict:
    return {"work": tree_digest(work), **_shared_digests(shared)}


@pytest.fixture(scope="module")
def shared_as_made(shared) -> dict:
    """The digests of the shared inputs as the fixture made them: every case leaves them so (hashed once before the
    cases, not again before each: after each case they must still be as made, so no case changes them)."""
    return _shared_digests(shared)


@pytest.mark.parametrize("case", sorted(CATALOGUE))
def test_bad_input(case, work, shared, shared_as_made):
    argv, phrases = CATALOGUE[case]
    before = {"work": tree_digest(work), **shared_as_made}
    assert_user_error(runner.invoke(app, _argv(argv, shared)), phrases)
    assert _digests(work, shared) == before, "nothing is committed and no input changes"


@pytest.mark.parametrize("case", sorted(USAGE))
def test_bad_usage(case, work, shared, shared_as_made):
    argv, phrases = USAGE[case]
    before = {"work": tree_digest(work), **shared_as_made}
    result = runner.invoke(app, _argv(argv, shared))
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.replace("│", " ").split())
    for phrase in phrases:
        assert phrase in text, f"{phrase!r} not in:\n{result.output}"
    assert "Traceback" not in result.output and "--help" in text, "Click names the option and where to look"
    assert _digests(work, shared) == before


def test_every_numeric_option_states_its_bounds():
    """Every int or float option of every command has a lower bound (typer's min), and --help states it."""
    import typer.main

    commands = typer.main.get_command(app).commands
    numeric = [(name, p) for name, c in commands.items() for p in c.params if p.bare_type() in ("int", "float")]
    assert len(numeric) >= 15
    unbounded = [f"{name} --{p.name}" for name, p in numeric if p.min is None]
    assert not unbounded, f"options without bounds: {unbounded}"
    for name in sorted({name for name, _ in numeric}):
        text = " ".join(runner.invoke(app, [name, "--help"]).output.replace("│", " ").split())
        for _, p in [(n, p) for n, p in numeric if n == name]:
            assert f"x>={p.min}" in text or f"{p.min}<=x" in text, f"{name} --help does not state --{p.name}'s bounds"


def test_catalogue_covers_every_command():
    """Every command of the CLI has bad inputs here or in the table commands' catalogue (test_bad_input*.py)."""
    import typer.main

    commands = set(typer.main.get_command(app).commands)
    here = {argv[0] for argv, _ in [*CATALOGUE.values(), *USAGE.values()]}
    elsewhere = {"recompute", "validate", "inspect", "score", "logprobs", "values", "train-step"}
    assert commands <= here | elsewhere, f"commands without a bad-input case: {sorted(commands - here - elsewhere)}"
    assert len(CATALOGUE) + len(USAGE) >= 60
