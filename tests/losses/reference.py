"""An independent, deliberately plain reference of the actor losses (spec §6.3, §6.5, §6.6), written row by row in
float64 from the spec text. By default it computes the CORRECTED semantics (BUG-7/8/9 fixed); ``roll=True`` follows
the spec's description of ROLL, defects included (token-mean numerators over every position, pass rates counting
padding, difficulty weights never applied, counts taken before the filter).

Tests check ``roll=True`` against every golden case (which validates the reference, defect conditions included) and
our default implementation against ``roll=False`` on every case. A case encodes a defect exactly when the two modes
disagree on it: the conditions of §13 evaluated on the case's params and inputs, not a list of names.

It is slow (Python loops over rows, runs and tokens) and only meant for the small golden batches.
"""

from __future__ import annotations

import math

import numpy as np
import torch

E = 1e-8
F64 = torch.float64


def runs(mask_row: list[int]) -> list[tuple[int, int]]:
    """Maximal runs [s, e) of 1s."""
    out, start = [], None
    for t, v in enumerate(list(mask_row) + [0]):
        if v and start is None:
            start = t
        if not v and start is not None:
            out.append((start, t))
            start = None
    return out


def row_mean(x: torch.Tensor, m: list[int]) -> torch.Tensor:
    idx = [t for t, v in enumerate(m) if v]
    return sum(x[t] for t in idx) / (len(idx) + E) if idx else torch.zeros((), dtype=F64)


def row_sum(x: torch.Tensor, m: list[int]) -> torch.Tensor:
    idx = [t for t, v in enumerate(m) if v]
    return sum(x[t] for t in idx) if idx else torch.zeros((), dtype=F64)


def segment_mean_row(x: torch.Tensor, m: list[int]) -> torch.Tensor:
    out = [torch.zeros((), dtype=F64)] * len(m)
    for s, e in runs(m):
        mean = sum(x[t] for t in range(s, e)) / ((e - s) + E)
        for t in range(s, e):
            out[t] = mean
    return torch.stack(out)


def aggregate(rows: list[torch.Tensor], masks: list[list[int]], mode: str, n_tok: float, n_seq: float,
              weights: list[float] | None = None, roll: bool = False) -> torch.Tensor:
    """agg_loss (§6.1). Corrected: the token-mean numerator sums masked tokens only; ``roll``: all positions [BUG-7]."""
    w = weights or [1.0] * len(rows)
    if mode == "token-mean":
        if roll:
            return sum(w[b] * rows[b].sum() for b in range(len(rows))) / n_tok
        return sum(w[b] * row_sum(rows[b], masks[b]) for b in range(len(rows))) / n_tok
    per_row = row_sum if mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm") else row_mean
    total = sum(w[b] * per_row(rows[b], masks[b]) for b in range(len(rows)) if any(masks[b]))
    if mode == "seq-mean-token-sum-norm":
        return total / len(masks[0])
    return total / (n_seq + E)


def ratios_row(gap: torch.Tensor, m: list[int]) -> dict[str, torch.Tensor]:
    T = len(m)
    return {"token": torch.exp(gap), "geometric": torch.exp(row_mean(gap, m)).expand(T),
            "sequence": torch.exp(row_sum(gap, m)).expand(T), "segment": torch.exp(segment_mean_row(gap, m))}


def diffs_row(d: torch.Tensor, m: list[int]) -> dict[str, torch.Tensor]:
    T = len(m)
    return {"token": d, "geometric": row_mean(d, m).expand(T), "sequence": row_sum(d, m).expand(T),
            "segment": segment_mean_row(d, m)}


def correction(cfg: dict, M: list[list[int]], old: torch.Tensor, infer: torch.Tensor, n_seq: float, n_tok: float,
               roll: bool = False):
    """§6.6: (is_weight rows, filter rows, metrics). Corrected: the rates count masked tokens only; ``roll``: their
    numerators run over every position, padding included [BUG-9]."""
    B = len(M)
    counted = (lambda b, t: True) if roll else (lambda b, t: bool(M[b][t]))  # noqa: E731
    ratios = [ratios_row(old[b] - infer[b], M[b]) for b in range(B)]
    diffs = [diffs_row(torch.exp(old[b]) - torch.exp(infer[b]), M[b]) for b in range(B)]
    metrics = {}
    for agg in ("token", "geometric", "sequence", "segment"):
        metrics[f"actor/train_infer_ratio_{agg}_mean@sum"] = float(
            aggregate([r[agg] for r in ratios], M, "seq-mean-token-mean", n_tok, n_seq))
        metrics[f"actor/train_infer_diff_{agg}_mean@sum"] = float(
            aggregate([d[agg] for d in diffs], M, "seq-mean-token-mean", n_tok, n_seq))
    isw_cfg = {"enabled": False, "weight_type": "token", "upper_bound": 1.2, **(cfg.get("is_weight") or {})}
    T = len(M[0])
    if isw_cfg["enabled"]:
        isw = [r[isw_cfg["weight_type"]].detach().clone() for r in ratios]
        ub = isw_cfg["upper_bound"]
        if ub is not None:
            metrics["actor/is_weight_clipfrac@sum"] = sum(
                float(isw[b][t] > ub) for b in range(B) for t in range(T) if counted(b, t)) / n_tok
            isw = [w.clamp(0, ub) for w in isw]
    else:
        isw = [torch.ones(T, dtype=F64) for _ in range(B)]
    keep = [[1] * T for _ in range(B)]
    filters = cfg.get("filters") or []
    for f in filters:
        f = {"enabled": False, "agg_type": "token", "ratio_enabled": True, "ratio_low": 0.8, "ratio_high": 1.2,
             "diff_enabled": False, "diff_low": -0.2, "diff_high": 0.2, **f}
        if not f["enabled"]:
            continue
        for kind, values in (("ratio", ratios), ("diff", diffs)):
            if not f[f"{kind}_enabled"]:
                continue
            lo, hi, agg = f[f"{kind}_low"], f[f"{kind}_high"], f["agg_type"]
            passed = [[int(lo <= float(values[b][agg][t]) <= hi) for t in range(T)] for b in range(B)]
            metrics[f"actor/train_infer_{agg}_{kind}_mask_mean@sum"] = sum(
                passed[b][t] for b in range(B) for t in range(T) if counted(b, t)) / n_tok
            keep = [[keep[b][t] * passed[b][t] for t in range(T)] for b in range(B)]
    if filters:
        kept = sum(keep[b][t] for b in range(B) for t in range(T) if M[b][t])
        metrics["actor/train_infer_final_mask_mean"] = kept / (sum(map(sum, M)) + E)
    return isw, keep, metrics


def log_probs_rows(logits: torch.Tensor, ids: np.ndarray, M: list[list[int]]) -> list[torch.Tensor]:
    rows = []
    for b in range(len(M)):
        lsm = torch.log_softmax(logits[b, :-1], dim=-1)
        rows.append(torch.stack([lsm[t, int(ids[b, t + 1])] if M[b][t] else torch.zeros((), dtype=F64)
                                 for t in range(len(M[b]))]))
    return rows


def entropy_rows(logits: torch.Tensor, M: list[list[int]]) -> list[torch.Tensor]:
    rows = []
    for b in range(len(M)):
        z = logits[b, :-1]
        h = torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1)
        rows.append(h * torch.tensor(M[b], dtype=F64))
    return rows


def _count(mask: list[list[int]]) -> tuple[float, float]:
    """(tokens, rows with a token), each at least 1 (spec §6.2 / ``loss_normalisers``)."""
    return float(max(sum(map(sum, mask)), 1)), float(max(sum(any(r) for r in mask), 1))


def reference_actor_loss(inputs: dict[str, np.ndarray], p: dict, kind: str, *, roll: bool = False,
                         ) -> tuple[float, dict, np.ndarray]:
    """Agentic ('agentic') or RLVR ('rlvr') actor loss of a golden case: (total, metrics, d total / d logits).

    ``p``: ROLL's params plus ``recompute`` (enable_old_logprobs_recompute: the IS weight comes precomputed) and
    ``cache`` (ROLL's cache path, §6.3 step 2: old = detach(current log-probs), ratio 1). Inputs ``ref_log_probs``
    and ``infer_logprobs`` default to old; the global counts to counts of the loss mask (after the filter when
    corrected, before it with ``roll``); ``final_response_mask`` (RLVR) to the response mask."""
    logits = torch.tensor(inputs["logits"], dtype=F64, requires_grad=True)
    M = inputs["response_mask"][:, 1:].astype(int).tolist()
    B, T = len(M), len(M[0])
    lp = log_probs_rows(logits, inputs["input_ids"], M)
    old = torch.stack([r.detach() for r in lp]) if p.get("cache") else torch.tensor(inputs["old_log_probs"], dtype=F64)
    ref = torch.tensor(inputs["ref_log_probs"], dtype=F64) if "ref_log_probs" in inputs else old
    infer = torch.tensor(inputs["infer_logprobs"], dtype=F64) if "infer_logprobs" in inputs else old
    adv = torch.tensor(inputs["advantages"], dtype=F64)
    given_tok = float(inputs["batch_num_tokens"]) if "batch_num_tokens" in inputs else None
    given_seq = float(inputs["global_valid_samples"]) if "global_valid_samples" in inputs else None
    clip_lo, clip_hi = (p.get("pg_clip_low", 0.2), p.get("pg_clip_high", 0.2)) if p.get("use_pg_clip_range") \
        else (p.get("pg_clip", 0.2), p.get("pg_clip", 0.2))
    mode = p.get("loss_agg_mode", "seq-mean-token-mean")
    isw_enabled = (p.get("train_infer_correction") or {}).get("is_weight", {}).get("enabled", False) or \
        p.get("is_weight.enabled", False) or p.get("train_infer_correction.is_weight.enabled", False)
    metrics = {}
    if p["recompute"]:
        isw = [torch.tensor(inputs["train_infer_is_weight"][b], dtype=F64) for b in range(B)]
        keep = [[1] * T for _ in range(B)]
    else:
        pre_tok, pre_seq = _count(M)
        isw, keep, metrics = correction(p.get("train_infer_correction") or {}, M, old, infer,
                                        pre_seq if given_seq is None else given_seq,
                                        pre_tok if given_tok is None else given_tok, roll=roll)
    m = [[M[b][t] * keep[b][t] for t in range(T)] for b in range(B)]
    given_final = kind == "rlvr" and "final_response_mask" in inputs
    fm_given = inputs["final_response_mask"].astype(int).tolist() if given_final else M
    fm = [[fm_given[b][t] * keep[b][t] for t in range(T)] for b in range(B)]
    n_tok, n_seq = _count(M if roll else m)
    n_tok, n_seq = (n_tok if given_tok is None else given_tok), (n_seq if given_seq is None else given_seq)
    if kind == "rlvr":
        f_tok, f_seq = _count(fm_given if roll else fm)
    else:
        f_tok, f_seq = n_tok, n_seq

    def masked(x: torch.Tensor, mask_row: list[int]) -> torch.Tensor:
        return x * torch.tensor(mask_row, dtype=F64)

    ratio = []
    for b in range(B):
        gap = lp[b] - old[b]
        if kind == "agentic" and p.get("ratio_type") == "segment":
            gap = segment_mean_row(gap, m[b])
        if kind == "rlvr" and p.get("importance_sampling") == "seq":
            gap = row_mean(gap, fm[b]).expand(T)
        ratio.append(torch.exp(gap))
    c = 1 + 2 * p.get("pg_clip", 0.2)
    loss_rows, s1_rows, s2_rows = [], [], []
    for b in range(B):
        s1 = ratio[b] * adv[b]
        s2 = ratio[b].clamp(1 - clip_lo, 1 + clip_hi) * adv[b]
        loss = -torch.min(s1, s2)
        if p.get("dual_clip_loss"):
            loss = torch.where(adv[b] < 0, torch.min(loss, -c * adv[b]), loss)
        if isw_enabled:
            loss = loss * isw[b]
        loss_rows.append(loss), s1_rows.append(s1), s2_rows.append(s2)

    weights = None
    if kind == "rlvr":
        w = np.ones(B)
        if p.get("difficulty_loss_weight") and not roll:            # ROLL never applies it [BUG-8]
            w = w * (0.5 + 1.5 * np.clip(np.asarray(inputs["difficulty"], dtype=float), 0, 1))
        if p.get("length_loss_weight"):
            L = np.array([sum(r) for r in m], dtype=float)
            w = w * (1.5 - (L - L.min()) / (L.max() - L.min() + E))
        weights = list(w * B / (w.sum() + E)) if w.sum() > 0 else list(w)
        metrics.update({"actor/sample_weights_mean@mean": float(np.mean(weights)),
                        "actor/sample_weights_min@min": float(np.min(weights)),
                        "actor/sample_weights_max@max": float(np.max(weights))})

    pg = aggregate(loss_rows, fm, mode, f_tok, f_seq, roll=roll)
    weighted_pg = aggregate(loss_rows, fm, mode, f_tok, f_seq, weights, roll=roll)
    kl_rows = []
    for b in range(B):
        k = ref[b] - lp[b]
        kl_rows.append(masked((torch.exp(k) - k - 1).clamp(-10, 10), fm[b]))
    kl = aggregate(kl_rows, fm, mode, f_tok, f_seq, roll=roll)
    total = weighted_pg + p.get("kl_loss_coef", 0.0) * kl if p.get("use_kl_loss") else weighted_pg
    total = total * p.get("rl_loss_coef", 1.0)
    if p.get("entropy_loss_coef", 0.0) > 0:
        entropy_mask = M if roll and kind == "rlvr" else m            # RLVR: ROLL's unfiltered response mask
        total = total - p["entropy_loss_coef"] * aggregate(entropy_rows(logits, M), entropy_mask, mode, n_tok, n_seq,
                                                           roll=roll)
    total.backward()

    ratio = [r.detach() for r in ratio]
    counted = (lambda b, t: True) if roll else (lambda b, t: bool(fm[b][t]))  # noqa: E731

    def rate(pred) -> float:
        return sum(float(pred(b, t)) for b in range(B) for t in range(T) if counted(b, t)) / f_tok

    lpd = [r.detach() for r in lp]
    metrics.update({
        "actor/pg_loss@sum": float(pg.detach()), "actor/kl_loss@sum": float(kl.detach()),
        "actor/total_loss@sum": float(total.detach()),
        "actor/ppo_ratio_high_clipfrac@sum": rate(lambda b, t: ratio[b][t] > 1 + clip_hi),
        "actor/ppo_ratio_low_clipfrac@sum": rate(lambda b, t: ratio[b][t] < 1 - clip_lo),
        "actor/ppo_ratio_clipfrac@sum": rate(lambda b, t: (ratio[b][t] > 1 + clip_hi) or (ratio[b][t] < 1 - clip_lo)),
        "actor/ratio_max@max": max(float(ratio[b][t]) if m[b][t] else 0.0 for b in range(B) for t in range(T)),
        "actor/ratio_min@min": min(float(ratio[b][t]) if m[b][t] else 1e10 for b in range(B) for t in range(T)),
        "actor/ratio_mean@sum": float(aggregate(ratio, m, "seq-mean-token-mean", n_tok, n_seq)),
        "actor/clipfrac@sum": float(aggregate([(s2_rows[b] < s1_rows[b]).to(F64) for b in range(B)], m, mode,
                                              f_tok, n_seq, roll=roll)),
        "actor/approxkl@sum": float(aggregate([masked(0.5 * (lpd[b] - old[b]) ** 2, m[b]) for b in range(B)], m,
                                              mode, n_tok, n_seq, roll=roll)),
        "actor/policykl@sum": float(aggregate([masked(lpd[b] - old[b], m[b]) for b in range(B)], m, mode, n_tok,
                                              n_seq, roll=roll)),
    })
    if kind == "rlvr":
        valid = sum(any(r) for r in fm)
        metrics.update({"actor/weighted_pg_loss@sum": float(weighted_pg.detach()),
                        "actor/valid_samples@sum": float(valid), "actor/total_samples@sum": float(B),
                        "actor/valid_sample_ratio@sum": valid / n_seq})
    assert math.isfinite(float(total.detach()))
    return float(total.detach()), metrics, logits.grad.numpy()
