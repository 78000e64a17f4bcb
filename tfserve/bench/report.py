"""What `python -m tfserve.bench.compare` reports: the machine, each engine's best rows over
the passes, the ratios tfserve / CTranslate2, and how far the outputs agree."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

from tfserve.bench.common import cpu_count

# the (numerator, denominator) engine pairs whose tokens/s ratios are reported
RATIOS = (("tfserve-fp32", "ct2-fp32"), ("tfserve-int8", "ct2-int8"),
          ("tfserve-fp32", "hf-eager"))


def machine() -> dict[str, Any]:
    """The CPU, usable cores, Python, load average and versions of the packages compared."""
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = cpu_count()
    versions = {}
    for module in ("onnxruntime", "ctranslate2", "torch", "transformers", "numpy"):
        try:
            from importlib.metadata import version

            versions[module] = version(module)
        except Exception:  # noqa: BLE001 - a missing package is reported as such
            versions[module] = None
    return {"cpu": cpu, "cores": cores, "python": platform.python_version(),
            "loadavg": [round(x, 2) for x in os.getloadavg()], "versions": versions}


def agreement(outputs: dict[str, dict[str, list[list[int]]]], reference: str,
              case: str) -> dict[str, Any]:
    """Identical outputs and matching tokens (position by position) against `reference`."""
    result = {}
    ref = outputs.get(reference, {}).get(case)
    for name, cases in outputs.items():
        other = cases.get(case)
        if name == reference or ref is None or other is None:
            continue
        same = sum(a == b for a, b in zip(ref, other))
        tokens = sum(x == y for a, b in zip(ref, other) for x, y in zip(a, b))
        total = sum(len(a) for a in ref)
        result[name] = {"identical": f"{same}/{len(ref)}", "tokens": round(tokens / total, 3)}
    return result


def format_agreement(agree: dict[str, dict[str, Any]], reference: str) -> str:
    """`agreement` per case as console lines."""
    lines = [f"outputs identical to {reference} (sentences; tokens matching position by "
             "position):"]
    for case, per_engine in agree.items():
        lines.append(f"  {case}: " + ", ".join(f"{name} {v['identical']} ({v['tokens']:.0%})"
                                               for name, v in per_engine.items()))
    return "\n".join(lines)


def best_rows(rows: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """Each (engine, case)'s fastest row over the passes."""
    best: dict[tuple[str, str], dict[str, Any]] = {}
    for row in rows:
        key = (row["engine"], row["case"])
        if key not in best or row["tok_s"] > best[key]["tok_s"]:
            best[key] = row
    return best


def ratios(rows: list[dict[str, Any]], cases: list[str]) -> dict[str, float]:
    """Tokens/s of engine A over engine B's (best rows) keyed "A/B/case", the RATIOS pairs."""
    by = best_rows(rows)
    return {f"{a}/{b}/{case}": round(by[(a, case)]["tok_s"] / by[(b, case)]["tok_s"], 3)
            for a, b in RATIOS for case in cases if (a, case) in by and (b, case) in by}


def format_table(rows: list[dict[str, Any]], summaries: dict[str, dict[str, Any]],
                 cases: list[str], engines: list[str]) -> str:
    """Tokens/s per engine and case with peak RSS, then the ratios of the RATIOS pairs."""
    by = best_rows(rows)
    lines = ["tokens/s (best of --repeat and --passes; output tokens = sentences x new tokens)",
             f"{'engine':<14}" + "".join(f"{c:>13}" for c in cases) + f"{'peak RSS MiB':>14}"]
    for engine in engines:
        cells = [f"{by[(engine, c)]['tok_s']:>13.1f}" if (engine, c) in by else f"{'-':>13}"
                 for c in cases]
        rss = summaries.get(engine, {}).get("peak_rss_mib")
        lines.append(f"{engine:<14}" + "".join(cells)
                     + (f"{rss:>14.0f}" if rss is not None else f"{'-':>14}"))
    lines.append("")
    lines.append(f"{'ratio':<28}" + "".join(f"{c:>13}" for c in cases))
    for a, b in RATIOS:
        if a not in engines or b not in engines:
            continue
        cells = []
        for c in cases:
            if (a, c) in by and (b, c) in by:
                cells.append(f"{by[(a, c)]['tok_s'] / by[(b, c)]['tok_s']:>12.2f}x")
            else:
                cells.append(f"{'-':>13}")
        lines.append(f"{a + ' / ' + b:<28}" + "".join(cells))
    return "\n".join(lines)
