"""A sweep's tables: one CSV row per run, and the paper's metric as mean +- std over seeds
per grid point in Markdown."""

from __future__ import annotations

import csv
import datetime
import re
from pathlib import Path

import numpy as np

from experiments.sweep.grid import flag_value
from experiments.sweep.runs import SPIKE_EPOCHS


def group_rows(rows: list[dict], fields: list[str]) -> list[dict]:
    """Mean +- std of the metric over seeds, per combination of the other grid fields."""
    keys = [f for f in fields if f != "seed"]
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault(tuple(flag_value(row[k]) for k in keys), []).append(row)
    out = []
    for key, members in sorted(groups.items(), key=lambda kv: [_order(v) for v in kv[0]]):
        done = [r for r in members if r["status"] == "done"]
        errors = np.array([r["error"] for r in done], dtype=float)
        train = np.array([r["train_error"] for r in done if r["train_error"] is not None])
        spikes = [r["loss_spike"] for r in members if r.get("loss_spike") is not None]
        out.append(
            {
                **dict(zip(keys, key, strict=True)),
                "runs": len(members),
                "done": len(done),
                "other": ", ".join(sorted({r["status"] for r in members} - {"done"})),
                "mean": float(errors.mean()) if len(errors) else None,
                "std": float(errors.std(ddof=1)) if len(errors) > 1 else None,
                "train_mean": float(train.mean()) if len(train) else None,
                "peak_lr": done[0]["peak_lr"] if done else None,
                "spike": max(spikes) if spikes else None,  # the worst seed's
                "seeds": [r.get("seed") for r in done],
            }
        )
    return out


def _order(value: str) -> tuple:
    """Numbers in numeric order, before words (kept in the order given)."""
    try:
        return (0, float(value), "")
    except ValueError:
        return (1, 0.0, "")


def pct(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{100 * value:.{digits}f}"


def shown(value) -> str:
    """A field's value for a reader (tables, legends): 5/90 as 0.5556, not 17 digits.

    Takes a value or its flag spelling (grouped rows hold the spelling); the CSV keeps
    the exact value.
    """
    text = str(value)
    if isinstance(value, float) or (isinstance(value, str) and "." in value):
        try:
            return f"{float(value):.4g}"
        except ValueError:
            pass
    return text


def write_tables(name: str, out: Path, rows: list[dict], fields: list[str], command: str):
    out.mkdir(parents=True, exist_ok=True)
    columns = list(
        dict.fromkeys(
            [
                *fields,
                "run",
                "status",
                "error",
                "final_error",
                "train_error",
                "steps",
                "peak_lr",
                "loss_spike",
                "seconds",
            ]
        )
    )
    with (out / f"{name}.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, columns, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: flag_value(row.get(k, "")) for k in columns})
    grouped = group_rows(rows, fields)
    keys = [f for f in fields if f != "seed"]
    seconds = sum(r.get("seconds") or 0 for r in rows)
    lines = [
        f"# {name}",
        "",
        f"Command: `{command}`",
        "",
        f"Written {datetime.date.today().isoformat()}; {sum(r['status'] == 'done' for r in rows)}"
        f" of {len(rows)} runs done; {seconds / 60:.0f} min of training in total. Error = the "
        "paper's metric (median top-1 validation error of the evaluations in the last 5/90 "
        "of training), in %, mean +- std over seeds. Loss spike = the largest rise of the "
        f"logged training loss above its lowest value so far in the first {SPIKE_EPOCHS:g} "
        "epochs, the worst seed's (diverged runs: up to their last log).",
        "",
        "| "
        + " | ".join(
            [
                *keys,
                "peak lr",
                "top-1 error (%)",
                "seeds",
                "final train error (%)",
                "loss spike",
                "not done",
            ]
        )
        + " |",
        "|" + "---|" * (len(keys) + 6),
    ]
    for g in grouped:
        spread = f" +- {pct(g['std'])}" if g["std"] is not None else ""
        lines.append(
            "| "
            + " | ".join(
                [
                    *[shown(g[k]) for k in keys],
                    "-" if g["peak_lr"] is None else f"{g['peak_lr']:.4g}",
                    f"{pct(g['mean'])}{spread}",
                    str(g["done"]),
                    pct(g["train_mean"]),
                    "-" if g["spike"] is None else f"{g['spike']:.2f}",
                    g["other"] or "",
                ]
            )
            + " |"
        )
    text, path = "\n".join(lines) + "\n", out / f"{name}.md"
    # The same table again (e.g. --collect_only) keeps the date it was first written on.
    if not (path.exists() and _undated(path.read_text()) == _undated(text)):
        path.write_text(text)
    return grouped


def _undated(text: str) -> str:
    return re.sub(r"^Written \d{4}-\d{2}-\d{2};", "Written;", text, count=1, flags=re.M)
