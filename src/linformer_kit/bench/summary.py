"""What a sweep says about the efficiency targets: ratios read off one run's rows."""

from __future__ import annotations

import statistics
from typing import Any

PEER_KINDS = ("lucidrains", "linformer-pytorch")
# A point of `peer_ratios`: n, the ratio, and its round-by-round quartiles (or None).
PeerPoint = tuple[int, float, list[float] | None]


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """For each of our variants: speed-up over the faster peer (by median and by
    best-of-rounds times, and the quartiles of its round-by-round ratios), fraction of the
    matmul ceiling (by median and by best-of-rounds times, each against the probe's same
    statistic), growth of time and peak memory from n/2 to n, speed-up and memory ratio
    over exact SDPA (at the same attention dropout), time over the same variant without
    attention dropout, and (for bfloat16) speed-up over float32 with the output's relative
    error. Peers, exact SDPA and the undropped variant are taken under the same
    torch.compile setting (eager with eager).

    Returns:
        {scope: {dtype: {"variant k=K": {n: {metric: value}}}}}; a metric is absent where
        its inputs were not measured.
    """
    index = {
        (r["scope"], r["dtype"], r["variant"], r["k"], r["n"]): r
        for r in rows
        if r["median_ms"] and r["status"] == "ok"  # emulated bf16 rows are not results
    }
    summary: dict[str, Any] = {}
    for (scope, dtype, variant, k, n), row in index.items():
        if row["kind"] != "ours":
            continue
        # The rows it is compared with: same scope, dtype, n and torch.compile setting.
        same = [
            r for key, r in index.items()
            if (key[0], key[1], key[4], r.get("compile")) == (scope, dtype, n, row.get("compile"))
        ]  # fmt: skip
        peers = [r for r in same if r["kind"] in PEER_KINDS and r["k"] == k]
        dropout = row["attention_dropout"]
        sdpa = next(
            (r for r in same if r["kind"] == "sdpa" and r["attention_dropout"] == dropout), None
        )
        undropped = next(
            (r for r in same if (r["kind"], r["sharing"], r.get("kernel"), r["k"],
                                 r["attention_dropout"])
             == ("ours", row["sharing"], row.get("kernel"), k, 0.0)),
            None,
        )  # fmt: skip
        half = index.get((scope, dtype, variant, k, n // 2))
        fp32 = index.get((scope, "float32", variant, k, n)) if dtype != "float32" else None
        entry: dict[str, Any] = {
            "median_ms": row["median_ms"],
            "ceiling_fraction": row["ceiling_fraction"],
            "ceiling_fraction_best": row["ceiling_fraction_best"],
            "speedup_vs_sdpa": row["speedup_vs_sdpa"],
        }
        if peers:
            faster = min(peers, key=lambda r: r["median_ms"])
            entry["speedup_vs_faster_peer"] = faster["median_ms"] / row["median_ms"]
            quartiles = _round_quartiles(faster, row)
            if quartiles:
                entry["speedup_vs_faster_peer_quartiles"] = quartiles
            if row.get("min_ms"):
                # Best-of-rounds times: on a shared machine, interference only adds time.
                best = min(r["min_ms"] for r in peers)
                entry["speedup_vs_faster_peer_by_min"] = best / row["min_ms"]
        if sdpa and sdpa["peak_mem_mb"] and row["peak_mem_mb"]:
            entry["memory_vs_sdpa"] = row["peak_mem_mb"] / sdpa["peak_mem_mb"]
        if dropout and undropped:
            entry["time_vs_no_attention_dropout"] = row["median_ms"] / undropped["median_ms"]
        if half:
            entry["time_growth_from_half_n"] = row["median_ms"] / half["median_ms"]
            if half["peak_mem_mb"] and row["peak_mem_mb"]:
                entry["memory_growth_from_half_n"] = row["peak_mem_mb"] / half["peak_mem_mb"]
        if fp32:
            entry["speedup_vs_float32"] = fp32["median_ms"] / row["median_ms"]
            entry["relative_error_vs_float32"] = row.get("relative_error_vs_float32")
        summary.setdefault(scope, {}).setdefault(dtype, {}).setdefault(f"{variant} k={k}", {})
        summary[scope][dtype][f"{variant} k={k}"][n] = entry
    return summary


def _round_quartiles(peer: dict[str, Any], ours: dict[str, Any]) -> list[float] | None:
    """The first and third quartiles of the peer's time over ours round by round: one n's
    rounds are interleaved (`timing.time_interleaved`), so round i of each row was timed in
    the same seconds of the machine. None with fewer than 4 rounds or rounds not paired."""
    theirs, mine = peer.get("times_ms"), ours.get("times_ms")
    if not theirs or not mine or len(theirs) != len(mine) or len(mine) < 4:
        return None
    first, _, third = statistics.quantiles([t / m for t, m in zip(theirs, mine)], n=4)
    return [first, third]


def peer_ratios(summary: dict[str, Any]) -> dict[tuple[str, str, str], list[PeerPoint]]:
    """The faster peer's median time over ours, (n, ratio, quartiles) by n, for each
    (scope, dtype, "variant k=K") of `summarise`'s result that has one (n may be text:
    bench.json read back); quartiles are those of the same ratio round by round, None where
    the run had too few rounds. Above 1, ours is faster."""
    ratios = {
        (scope, dtype, label): sorted(
            (
                int(n),
                entry["speedup_vs_faster_peer"],
                entry.get("speedup_vs_faster_peer_quartiles"),
            )
            for n, entry in by_n.items()
            if "speedup_vs_faster_peer" in entry
        )
        for scope, by_dtype in summary.items()
        for dtype, by_label in by_dtype.items()
        for label, by_n in by_label.items()
    }
    return {key: points for key, points in ratios.items() if points}
