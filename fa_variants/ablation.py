"""The FA3 ablation as data: what `bench/ablation.py --json` writes (each row one implementation on one shape, with
its time and TFLOP/s, and the run's card, commit and date), and what each of FA3's levers buys in it, which
`fa-variants explain fa3` prints. The repository ships one such file, measured on the H200 the library is developed
on (fa_variants/measured/); a run on another card replaces it with `--measured FILE`."""
from __future__ import annotations

import json
from pathlib import Path

from tabulate import tabulate

SHIPPED = Path(__file__).parent / "measured" / "fa3_ablation.json"

# The rows bench/ablation.py measures, and the lever each pair of them isolates: (lever, with, without).
LEVERS = (
    ("TMA + warp specialization (vs fa2's wgmma kernel)", "fa3 -pingpong -overlap", "fa2 (wgmma)"),
    ("ping-pong alone", "fa3 -overlap", "fa3 -pingpong -overlap"),
    ("intra-warpgroup overlap alone", "fa3 -pingpong", "fa3 -pingpong -overlap"),
    ("ping-pong, with the overlap", "fa3", "fa3 -pingpong"),
    ("all of FA3 over fa2", "fa3", "fa2 (wgmma)"),
    ("the shipped grid and tiles (by length)", "fa3 as shipped", "fa3"),
)


def load(path: str | Path | None = None) -> dict:
    """{"meta": {...}, "rows": [{shape, impl, ms, tflops, ...}]} from ``path`` (default: the shipped file)."""
    path = Path(path) if path is not None else SHIPPED
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise ValueError(f"cannot read the ablation results {path}: {e.strerror}") from None
    except ValueError as e:
        raise ValueError(f"{path} is not JSON: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list) or not data["rows"]:
        raise ValueError(f"{path} is not what `bench/ablation.py --json` writes (a 'meta' and a list of 'rows')")
    for r in data["rows"]:
        if not isinstance(r, dict) or not {"shape", "impl", "tflops"} <= r.keys():
            raise ValueError(f"{path}: a row without shape, impl and tflops: {r!r}")
    return data


def text(data: dict, source: str) -> str:
    """Each shape's rows (TFLOP/s, x fa3) and what each lever buys there, with where the numbers come from."""
    meta = data.get("meta", {})
    where = ", ".join(f"{k} {meta[k]}" for k in ("card", "commit", "date", "command") if meta.get(k))
    lines = [f"measured ({source}{': ' + where if where else ''}):"]
    shapes = list(dict.fromkeys(r["shape"] for r in data["rows"]))
    for shape in shapes:
        rows = {r["impl"]: r["tflops"] for r in data["rows"] if r["shape"] == shape}
        best = rows.get("fa3")
        table = [[impl, f"{tf:.1f}", f"{tf / best:.2f}" if best else ""] for impl, tf in rows.items()]
        lines += ["", f"  {shape}", tabulate(table, headers=["implementation", "TFLOP/s", "x fa3"], disable_numparse=True)]
        levers = [[lever, f"{rows[a] / rows[b]:.3f}x"] for lever, a, b in LEVERS if a in rows and b in rows]
        if levers:
            lines += [tabulate(levers, headers=["lever", "buys"], disable_numparse=True)]
    if meta.get("paper"):
        lines += ["", f"  paper: {meta['paper']}"]
    return "\n".join(lines)
