"""A benchmark's results: the JSON document, the text summary and the PNG.

The JSON (``build_report``) holds the run's configuration, pagoda's figures (throughput,
latency distributions in seconds, scheduler statistics), the HF baseline and the
roofline when asked for, the ratios between them, and the raw samples behind the plot.
The PNG (matplotlib, Agg backend: no display needed) has one CDF per latency and the
output throughput over time.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from pagoda.bench.stats import RequestRecord, record_lists, summarize, throughput_over_time

LATENCIES = (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("e2e_s", "E2E"))


def build_report(config: dict[str, Any], records: list[RequestRecord], scheduler: dict[str, Any],
                 hf: dict[str, Any] | None = None, roofline: dict[str, Any] | None = None,
                 *, vllm: dict[str, Any] | None = None, bs1: dict[str, float] | None = None,
                 cpu: dict[str, float | None] | None = None,
                 start_s: float | None = None) -> dict[str, Any]:
    """``cpu``: a launched stack's CPU seconds by role during the run (``CpuMeter``);
    ``start_s``: the offline engine's construction time (as vLLM's ``start_s``)."""
    pagoda = {**summarize(records), "scheduler": scheduler, "bs1": bs1, "cpu_s": cpu,
              "start_s": start_s}
    comparison = None
    vs_vllm = None
    if vllm is not None:
        vllm = {k: v for k, v in vllm.items() if k != "token_ids"}  # the figures only
        vs_vllm = {
            "output_tok_s_ratio": _ratio(pagoda["output_tok_s"], vllm["output_tok_s"]),
            # < 1 is faster
            "bs1_ttft_ratio": _ratio(bs1["ttft_s"], vllm["bs1_ttft_s"]) if bs1 else None,
            "bs1_tpot_ratio": _ratio(bs1["tpot_s"], vllm["bs1_tpot_s"]) if bs1 else None,
            "start_ratio": _ratio(start_s, vllm.get("start_s")),  # < 1 starts faster
        }
    if hf is not None:
        bs1 = hf.get("one_at_a_time")
        comparison = {
            "output_tok_s_ratio_vs_hf_best": _ratio(pagoda["output_tok_s"], hf["best_output_tok_s"]),
            # < 1 is faster; a bs1 comparison needs pagoda run at --max-concurrency 1
            "tpot_p50_ratio_vs_hf_bs1": _ratio(pagoda["tpot_s"]["p50"], bs1["tpot_s"]["p50"]) if bs1 else None,
            "pagoda_max_concurrency": config.get("max_concurrency"),
        }
    t, tok_s = throughput_over_time(records)
    return {
        "config": config,
        "pagoda": pagoda,
        "baseline_hf": hf,
        "comparison": comparison,
        "baseline_vllm": vllm,
        "comparison_vllm": vs_vllm,
        "roofline": roofline,
        "samples": {**record_lists(records),
                    "throughput_over_time": {"t_s": t, "output_tok_s": tok_s}},
    }


def add_online(report: dict[str, Any], records: list[RequestRecord],
               cpu: dict[str, float | None] | None, setup: dict[str, Any],
               rounds: list[dict[str, Any]] | None = None) -> None:
    """Adds the same requests served online (``--online``) beside the offline run: its
    figures, the CPU seconds by role, and online / offline output throughput. With
    ``rounds`` (``--online-rounds``: each an offline and an online pass, the first being
    the report's own) each round gets its ratio, and the headline is their geometric mean."""
    online = {**summarize(records), "cpu_s": cpu, **setup}
    report["online"] = online
    ratio = _ratio(online["output_tok_s"], report["pagoda"]["output_tok_s"])
    if rounds:
        for r in rounds:
            r["output_tok_s_ratio"] = _ratio(r["online_output_tok_s"], r["offline_output_tok_s"])
        ratio = _geometric_mean([r["output_tok_s_ratio"] for r in rounds])
    report["comparison_online"] = {"output_tok_s_ratio": ratio, "rounds": rounds}


def add_vllm_rounds(report: dict[str, Any], rounds: list[dict[str, Any]]) -> None:
    """``--vllm-rounds``: each round (a pagoda and a vLLM pass, the first being the
    report's own pair) gets its pagoda / vLLM ratio, and the headline output ratio becomes
    the geometric mean of rounds 1 on, whose two passes ran back to back (the first
    pair's ran minutes apart, the online rounds and exact-match check between them: its
    ratio stays as ``first_pass_output_tok_s_ratio``)."""
    vs = report["comparison_vllm"]
    for r in rounds:
        r["output_tok_s_ratio"] = _ratio(r["pagoda_output_tok_s"], r["vllm_output_tok_s"])
    vs["first_pass_output_tok_s_ratio"] = vs["output_tok_s_ratio"]
    vs["output_tok_s_ratio"] = _geometric_mean([r["output_tok_s_ratio"] for r in rounds[1:]])
    vs["rounds"] = rounds


def _geometric_mean(ratios: list[float | None]) -> float | None:
    ok = bool(ratios) and all(r is not None and r > 0 for r in ratios)
    return statistics.geometric_mean(ratios) if ok else None  # type: ignore[arg-type]


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b or math.isnan(a) or math.isnan(b):
        return None
    return a / b


def write_json(report: dict[str, Any], path: str | Path) -> None:
    # NaN is not JSON: an empty distribution becomes null
    Path(path).write_text(json.dumps(_finite(report), indent=2) + "\n", encoding="utf-8")


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def format_text(report: dict[str, Any]) -> str:
    p, cfg = report["pagoda"], report["config"]
    lines = [
        (f"pagoda bench: {cfg['mode']}, model {cfg['model']}, {p['num_requests']} requests "
         f"({p['num_failed']} failed), {p['prompt_tokens']} prompt + {p['output_tokens']} "
         f"output tokens"),
        f"  duration {p['duration_s']:.2f} s, mean in flight {_f(p['mean_in_flight'])}",
        (f"  output {_f(p['output_tok_s'])} tok/s, total {_f(p['total_tok_s'])} tok/s, "
         f"{_f(p['requests_s'], 3)} req/s"),
        f"  {'ms':<8}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}",
    ]
    for key, name in LATENCIES:
        d = p[key]
        lines.append(f"  {name:<8}" + "".join(f"{_f(d[k] * 1e3 if d[k] is not None else None):>10}"
                                               for k in ("mean", "p50", "p90", "p99")))
    s = p["scheduler"]
    lines.append(f"  scheduler: KV usage peak {_pct(s['kv_usage_peak'])}, preemptions "
                 f"{_f(s['num_preemptions'], 0)}, prefix-cache hits {_f(s['prefix_cache_hits'], 0)}"
                 f"/{_f(s['prefix_cache_queries'], 0)} tokens ({_pct(s['prefix_cache_hit_rate'])})")
    if p.get("cpu_s"):
        lines.append("  " + _cpu_text(p["cpu_s"]))
    o = report.get("online")
    if o is not None:
        lines.append(f"  online ({o['transport']}, {o['frontends']} frontends, concurrency "
                     f"{o['max_concurrency'] or 'unlimited'}): output {_f(o['output_tok_s'])} "
                     f"tok/s ({o['num_failed']} failed), TTFT p50 "
                     f"{_f(_ms(o['ttft_s']['p50']))} ms, TPOT p50 {_f(_ms(o['tpot_s']['p50']))} ms")
        cmp_online = report["comparison_online"]
        lines.append(f"  online / offline output tok/s: "
                     f"{_f(cmp_online['output_tok_s_ratio'], 3)}x")
        if cmp_online.get("rounds"):
            rounds = cmp_online["rounds"]
            lines[-1] += f", geometric mean of {len(rounds)} rounds in alternating order:"
            launches = len({r.get("launch", 0) for r in rounds})
            if launches > 1:
                lines[-1] = lines[-1][:-1] + f" over {launches} launches of the stack:"
            lines += [f"    round {i}: offline {_f(r['offline_output_tok_s'])}, online "
                      f"{_f(r['online_output_tok_s'])} tok/s ("
                      f"{'online' if r['online_first'] else 'offline'} first"
                      + (f", launch {r.get('launch', 0)}" if launches > 1 else "") + "): "
                      f"{_f(r['output_tok_s_ratio'], 3)}x" for i, r in enumerate(rounds)]
        if o.get("cpu_s"):
            lines.append("  online " + _cpu_text(o["cpu_s"]))
    hf, cmp = report["baseline_hf"], report["comparison"]
    if hf is not None and cmp is not None:
        for dtype, by_bs in hf["static_batch_output_tok_s"].items():
            ways = ", ".join(f"bs{k} {_f(v)}" for k, v in by_bs.items())
            lines.append(f"  HF generate ({dtype}) output tok/s: {ways}")
        lines.append(f"  HF best: {hf['best_dtype']} bs{hf['best_batch_size']} {_f(hf['best_output_tok_s'])}")
        lines.append(f"  pagoda / HF best: {_f(cmp['output_tok_s_ratio_vs_hf_best'], 2)}x")
        if cmp["tpot_p50_ratio_vs_hf_bs1"] is not None:
            lines.append(f"  TPOT p50 pagoda / HF one-at-a-time ({hf['one_at_a_time_dtype']}): "
                         f"{_f(cmp['tpot_p50_ratio_vs_hf_bs1'], 2)} "
                         f"(pagoda at max concurrency {cmp['pagoda_max_concurrency'] or 'unlimited'})")
    v, vs = report.get("baseline_vllm"), report.get("comparison_vllm")
    if v is not None and vs is not None:
        b = p.get("bs1") or {}
        lines.append(f"  vLLM CPU: output {_f(v['output_tok_s'])} tok/s, bs1 TTFT "
                     f"{_f(v['bs1_ttft_s'] * 1e3)} ms, TPOT {_f(v['bs1_tpot_s'] * 1e3)} ms, "
                     f"start {_f(v['start_s'])} s")
        if b:
            start = p.get("start_s")
            lines.append(f"  pagoda:   bs1 TTFT {_f(b['ttft_s'] * 1e3)} ms, TPOT "
                         f"{_f(b['tpot_s'] * 1e3)} ms"
                         + (f", start {_f(start)} s" if start is not None else ""))
        lines.append(f"  pagoda / vLLM output tok/s: {_f(vs['output_tok_s_ratio'], 2)}x; bs1 TTFT "
                     f"{_f(vs['bs1_ttft_ratio'], 2)}, TPOT {_f(vs['bs1_tpot_ratio'], 2)} (< 1 faster)")
        if vs.get("rounds"):
            rounds = vs["rounds"]
            lines.append(f"    (the geometric mean of rounds 1-{len(rounds) - 1}, each a pagoda and a "
                         f"vLLM pass back to back in alternating order; round 0, the first "
                         f"passes, ran minutes apart: {_f(vs['first_pass_output_tok_s_ratio'], 2)}x)")
            lines += [f"    round {i}: pagoda {_f(r['pagoda_output_tok_s'])}, vLLM "
                      f"{_f(r['vllm_output_tok_s'])} tok/s "
                      f"({'vLLM' if r['vllm_first'] else 'pagoda'} first): "
                      f"{_f(r['output_tok_s_ratio'], 3)}x" for i, r in enumerate(rounds)]
    e = report.get("exact_match")
    if e is not None:
        lines.append(f"  exact match vs {e['oracle']} (KV cache {e['kv_cache_dtype']}): "
                     f"{e['exact']}/{e['requests']} requests whole ({_pct(e['exact_rate'])}), "
                     f"{_pct(e['token_agreement'])} of output tokens before the first "
                     f"difference")
    r = report["roofline"]
    if r is not None:
        lines.append(f"  machine: {r.get('matmul_dtype', 'float32')} matmul {r['matmul_flops'] / 1e9:.1f} GFLOP/s, memory read "
                     f"{r['mem_read_bytes_s'] / 1e9:.1f} GB/s; model {r['params'] / 1e6:.1f} M params "
                     f"x {r['bytes_per_param']} B")
        lines.append(f"  roofline at B = {r['batch']:.1f}: ceiling {_f(r['ceiling_output_tok_s'])} "
                     f"output tok/s ({r['bound']}-bound); pagoda reached {_pct(r['fraction'])}")
        if r.get("bs1_tpot_vs_weights_read") is not None:
            lines.append(f"  bs1 TPOT {_f(p['bs1']['tpot_s'] * 1e3, 2)} ms = "
                         f"{_f(r['bs1_tpot_vs_weights_read'], 2)}x one read of the weights "
                         f"({_f(r['bs1_weights_read_s'] * 1e3, 2)} ms at "
                         f"{r['bs1_mem_read_bytes_s'] / 1e9:.1f} GB/s, measured around the probe: "
                         + ", ".join(f"{b / 1e9:.1f}" for b in r["bs1_mem_read_samples"]) + ")")
        if r.get("steps"):
            lines.append("  the offline pass's steps beside their own roofline (matmuls at the "
                         "measured rate or one weight read, the larger; K/V reads at the "
                         "measured bandwidth apart, as the ceiling leaves them out):")
            for kind, b in _ordered_steps(r["steps"]):
                lines.append(f"    {kind + ':':<19}{b['steps']:>5.0f} steps {b['seconds']:8.2f} s; "
                             f"roofline {b['roofline_s']:7.2f} s ({_pct(b['share'])}), "
                             f"+ K/V {b['kv_read_s']:6.2f} s ({_pct(b['share_with_kv'])})")
        lines.append(f"  ({r['definition']})")
    return "\n".join(lines)


def _ordered_steps(steps: dict[str, dict[str, float]]) -> list[tuple[str, dict[str, float]]]:
    """Prefill, the decode kinds by rows, then the total."""
    from pagoda.bench.roofline import DECODE_BUCKETS, WIDEST_BUCKET

    order = ["prefill", *(name for _, name in DECODE_BUCKETS), WIDEST_BUCKET, "all"]
    return [(kind, steps[kind]) for kind in order if kind in steps]


def _cpu_text(cpu: dict[str, float | None]) -> str:
    wall = cpu.get("wall_s") or 0.0
    parts = [f"{role} {_f(sec)}" for role, sec in cpu.items() if role != "wall_s"]
    return f"CPU seconds over {_f(wall)} s wall: " + ", ".join(parts)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def _f(x: float | None, digits: int = 1) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _pct(x: float | None) -> str:
    return "-" if x is None or math.isnan(x) else f"{100 * x:.1f}%"


def write_png(report: dict[str, Any], path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and in tests
    import matplotlib.pyplot as plt

    samples = report["samples"]
    hf_bs1 = (report.get("baseline_hf") or {}).get("one_at_a_time_samples")
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (key, name) in zip(axes.flat, LATENCIES):
        _cdf(ax, samples[key], "pagoda")
        if hf_bs1:
            _cdf(ax, hf_bs1[key], "HF one at a time")
        ax.set_title(f"{name} CDF")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of samples")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    ax = axes.flat[4]
    tot = samples["throughput_over_time"]
    ax.plot(tot["t_s"], tot["output_tok_s"], drawstyle="steps-mid")
    ax.set_title("output throughput over time")
    ax.set_xlabel("s since start")
    ax.set_ylabel("output tok/s")
    ax.grid(alpha=0.3)
    axes.flat[5].axis("off")
    axes.flat[5].text(0, 0.5, format_text(report).split("\n  (")[0], family="monospace", fontsize=6,
                      va="center")
    fig.suptitle(f"pagoda bench — {report['config']['model']} ({report['config']['mode']})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _cdf(ax: Any, values: list[float], label: str) -> None:
    if not values:
        return
    xs = sorted(v * 1e3 for v in values)
    ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label)
