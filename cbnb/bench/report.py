"""Text output of a bench report (`run_bench`'s dict): the header, the machine, the roofline and one row per peer."""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["format_report"]


def _si(x: float, unit: str) -> str:
    """``x`` with an SI prefix: 1.23e12, "FLOP" -> "1.23 TFLOP"."""
    for f, p in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= f:
            return f"{x / f:.3g} {p}{unit}"
    return f"{x:.3g} {unit}"


def _rng(s: dict[str, Any], fmt: Callable[[float], str]) -> str:
    if not s or s.get("median") is None:
        return "-"
    if s["n"] == 1:
        return fmt(s["median"])
    return f"{fmt(s['median'])} [{fmt(s['min'])}-{fmt(s['max'])}]"


def format_report(report: dict[str, Any]) -> str:
    """The report as text: medians with [min-max] over the rounds, ratios as the median of per-round ratios."""
    lines = []
    rounds = report["repeat"]
    lines.append(f"cbnb.bench {report['date']} on {report['machine']}")
    lines.append(f"workload {report['workload']}: {report['requests']} requests, {report['prompt_tokens']} prompt "
                 f"tokens, {report['output_tokens']} output tokens; model {report['model']} ({report['dtype']}, "
                 f"{report['device']}, {report['threads']} threads); {rounds} round(s), order rotated each round")
    cfg = report["config"]
    lines.append("config: " + ", ".join(f"{k}={cfg.get(k)}" for k in ("page_size", "num_blocks", "max_batch_tokens")))
    rf = report["roofline"]
    ms = report.get("machine_state")
    if ms:
        g = lambda x: f"{x / 1e9:.0f}"  # noqa: E731
        lines.append(f"machine (median [min-max] of the per-round probes): GEMM at the model's shapes "
                     f"{_rng(ms['prefill_flops_per_s'], g)} GFLOP/s at {rf['prefill_rows']} rows (prefill, body), "
                     f"{_rng(ms['decode_flops_per_s'], g)} GFLOP/s at {rf['decode_rows']} rows (decode, body + LM "
                     f"head); 1024^2 GEMM {_rng(ms['gemm_1024_flops_per_s'], g)} GFLOP/s; copy bandwidth "
                     f"{_rng(ms['copy_bytes_per_s'], lambda x: f'{x / 1e9:.1f}')} GB/s")
    w = rf["work"]
    lines.append(f"roofline work: {_si(w['flops'], 'FLOP')} = prefill {_si(w['flops_prefill'], 'FLOP')} "
                 f"({w['distinct_prompt_tokens']} distinct prompt tokens) + decode {_si(w['flops_decode'], 'FLOP')} "
                 f"({w['decode_tokens']} decode tokens, {w['output_tokens']} sampled); bytes {_si(w['bytes'], 'B')} "
                 f"({w['min_forwards']} forwards x {_si(rf['model']['weight_bytes'], 'B')} of weights + KV)")
    for k in ("flops_prefill", "flops_decode", "bytes", "compute_s", "bytes_s", "floor_s"):
        lines.append(f"  {k} = {rf['formulas'][k]}")
    if "floor_s" in rf:
        b = rf["best_rates"]
        lines.append(f"roofline floor at the best of {rf['probes']} probes' rates ({b['prefill_flops_per_s'] / 1e9:.0f} and "
                     f"{b['decode_flops_per_s'] / 1e9:.0f} GFLOP/s, {b['copy_bytes_per_s'] / 1e9:.1f} GB/s): compute "
                     f"{rf['compute_s']:.3g} s, bytes {rf['bytes_s']:.3g} s -> floor {rf['floor_s']:.3g} s = "
                     f"{rf['floor_tok_per_s']:.0f} output tok/s")
        if any((report["summary"][n]["roofline_share"].get("max") or 0) > 1 for n in report["peers"]):
            lines.append("WARNING: a peer ran faster than the floor: every probe of this run was slowed down "
                         "(contention), so the floor and the shares are not meaningful; the ratios still are")
    first = report["peers"][0]
    nw = max(22, 2 + max(len(n) for n in report["peers"]))  # variant names can be long
    rw = max(24, 2 + len(first + " / peer"))
    head = (f"{'peer':<{nw}}{'out tok/s':>24}{first + ' / peer':>{rw}}{'roofline share':>22}{'peak MiB':>10}"
            f"{'same tokens':>13}{'lone TTFT s':>20}{'lone ITL ms':>18}{'sample ms/step':>22}  errors")
    lines.append(head)
    for name in report["peers"]:
        s = report["summary"][name]
        agree = s["greedy_agreement_min"]
        share = _rng(s["roofline_share"], lambda x: f"{100 * x:.0f}%")
        lines.append(
            f"{name:<{nw}}{_rng(s['tok_per_s'], lambda x: f'{x:.1f}'):>24}"
            f"{_rng(s['first_over_this'], lambda x: f'{x:.2f}x'):>{rw}}{share:>22}"
            f"{s['peak_bytes_max'] / 2**20:>10.0f}{'-' if agree is None else f'{100 * agree:.0f}%':>13}"
            f" {_rng(s['lone_ttft_s'], lambda x: f'{x:.3f}'):>19}"
            f" {_rng(s.get('lone_itl_s') or {}, lambda x: f'{1e3 * x:.1f}'):>17}"
            f"{_rng(s.get('sample_ms_per_step') or {}, lambda x: f'{x:.2f}'):>22}  {'; '.join(sorted(set(s['errors'])))}")
    for name in report["peers"]:
        comp = report["summary"][name].get("compile") or {}
        for path, st in comp.items():
            if st:
                failed = f"; FAILED: {st['failed']}" if st["failed"] else ""
                lines.append(f"{name} compiled {path} forward: {st['compiles']} compile(s), {st['compile_s']:.1f} s "
                             f"(in this process; a shape first seen after the warm-up compiles inside that round's "
                             f"timing){failed}")
    for name in report["peers"]:
        fallbacks = sorted({rnd["results"][name].get("fallback") for rnd in report["rounds"]} - {None})
        if fallbacks:
            lines.append(f"{name} ran with {'; '.join(fallbacks)}")
    lines.append("per round (out tok/s, in run order):")
    for rnd in report["rounds"]:
        res = rnd["results"]
        parts = ", ".join(f"{n} {res[n]['output_tok_per_s']:.1f}" for n in rnd["order"])
        m = rnd.get("machine") or {}
        gemm = f"  | GEMM {m['prefill_flops_per_s'] / 1e9:.0f} GFLOP/s" if m else ""
        lines.append(f"  {rnd['index'] + 1}: {parts}{gemm}")
    return "\n".join(lines)
