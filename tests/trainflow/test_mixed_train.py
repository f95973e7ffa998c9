"""The console summary of a mixed FrozenLake + Sokoban evaluation. The mixed run itself (the shipped mixed config,
one iteration: both tags in the samples, the advantages and the evaluation, per-tag metrics in the metrics table,
TensorBoard and the report) runs end to end on the default model in tests/scenarios/test_default_model.py."""


def test_eval_summary_lists_each_tag_of_a_mixed_evaluation():
    from flows.agentic import eval_summary_lines

    metrics = {"rollout/success_rate": 0.5, "rollout/valid_action_rate": 0.75, "rollout/stop/max_steps": 1.0}
    for tag, rate in (("FrozenLake", 1.0), ("SimpleSokoban", 0.0)):
        metrics |= {f"rollout/{tag}/success_rate": rate, f"rollout/{tag}/valid_action_rate": 0.75,
                    f"rollout/{tag}/episodes": 2.0}
    lines = eval_summary_lines({"metrics": metrics, "checkpoint": "c", "episodes": 4, "output": "o"})
    tagged = [line.split() for line in lines if line.split()[0] in ("FrozenLake", "SimpleSokoban")]
    assert [(w[0], w[2]) for w in tagged] == [("FrozenLake", "1,"), ("SimpleSokoban", "0,")]
    single = {k: v for k, v in metrics.items() if "SimpleSokoban" not in k}
    assert not any(line.split()[0] == "FrozenLake" for line in eval_summary_lines(
        {"metrics": single, "checkpoint": "c", "episodes": 2, "output": "o"}))  # one tag: the totals say it all
