"""The demo's HTML report: its tables and three plots (matplotlib PNGs, embedded), one file
that opens anywhere.

* every tenant's learning curve in both phases, overlaid;
* each service's utilisation over time in both phases;
* the aggregate held time of both phases, split by service into busy, overhead and idle.
"""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path
from typing import TYPE_CHECKING, Any

import matplotlib

matplotlib.use("Agg")  # files only: no display here, and none is needed
import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator

from bench import scenario
from bench.gauges import SERVICES, Sampler

if TYPE_CHECKING:
    from bench.demo_results import PhaseRun

COLOURS = {"train": "#1f77b4", "infer": "#ff7f0e", "env": "#2ca02c"}
MODE_STYLE = {"isolated": "-", "shared": "--"}
WAIT_HEADER = [
    "mode",
    "SFT batch wait",
    "act round trip",
    "in inferencer",
    "forward",
    "observations per forward",
]
BREAKDOWN_HEADER = [
    "mode",
    "service",
    "held s",
    "busy s",
    "overhead s",
    "of it commits s",
    "idle s",
    "utilisation",
]


def _png(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def curves_png(result: dict[str, Any]) -> bytes:
    tenants = result["tenants"]
    fig, axes = plt.subplots(1, len(tenants), figsize=(4.2 * len(tenants), 3.2))
    for ax, t in zip(axes, tenants, strict=True):
        metric = t["final_metric_name"]
        for mode, key in (("isolated", "isolated"), ("shared", "multi")):
            values = t["curves"][key].get(metric, [])
            ax.plot(
                range(1, len(values) + 1),
                values,
                MODE_STYLE[mode],
                marker="o" if t["kind"] == "rl" else None,
                markersize=4,
                label=mode,
                alpha=0.85,
            )
        same = "identical" if t["curves_identical"] else f"max diff {t['curve_max_abs_diff']:.1e}"
        ax.set_title(f"{t['name']} ({t['head']}, {t['algorithm']})\n{same}", fontsize=9)
        ax.set_xlabel("iteration" if t["kind"] == "rl" else "step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(metric)
        ax.legend(fontsize=8)
    fig.suptitle("Learning curves: each tenant alone vs all four sharing the services", y=1.02)
    fig.tight_layout()
    return _png(fig)


def timeline_png(phases: dict[str, PhaseRun], sampler: Sampler) -> bytes:
    fig, axes = plt.subplots(2, 1, figsize=(11, 5.6), sharey=True)
    for ax, (mode, phase) in zip(axes, phases.items(), strict=True):
        points = sampler.timeline(phase.start, phase.end)
        for service in SERVICES:
            xs = [p[0] for p in points.get(service, [])]
            ys = [100 * p[1] for p in points.get(service, [])]
            ax.plot(xs, ys, color=COLOURS[service], label=service, linewidth=1.2)
        if mode == "isolated":
            for (start, _), tenant in zip(phase.windows, scenario.TENANTS, strict=False):
                ax.axvline(start - phase.start, color="grey", linewidth=0.6, linestyle=":")
                ax.text(start - phase.start, 102, f" {tenant.name}", fontsize=7, color="grey")
        ax.set_title(
            f"{mode}: utilisation (busy seconds per held second, per instance)", fontsize=10
        )
        ax.set_ylabel("%")
        ax.set_ylim(0, 110)
        ax.legend(fontsize=8, loc="upper right")
    axes[-1].set_xlabel("seconds since the phase started")
    fig.tight_layout()
    return _png(fig)


def aggregate_png(result: dict[str, Any]) -> bytes:
    fig, ax = plt.subplots(figsize=(8.5, 3.6))
    modes = list(result["time_breakdown"])
    bottoms = [0.0] * len(modes)
    for service in SERVICES:
        parts = (("busy_s", 1.0, ""), ("overhead_s", 0.55, "//"), ("idle_s", 0.2, ""))
        for part, alpha, hatch in parts:
            values = [result["time_breakdown"][m][service][part] for m in modes]
            ax.bar(
                modes,
                values,
                bottom=bottoms,
                color=COLOURS[service],
                alpha=alpha,
                hatch=hatch,
                edgecolor="white",
                label=f"{service} {part.removesuffix('_s')}",
            )
            bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    ax.set_ylabel("held seconds (sum over services)")
    reduction = result["aggregate_time_reduction"]
    ax.set_title(f"Aggregate held time: {reduction:.1%} less when shared", fontsize=10)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return _png(fig)


def _img(png: bytes, alt: str) -> str:
    data = base64.b64encode(png).decode()
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def headline_rows(result: dict[str, Any]) -> list[list[str]]:
    rows = [
        [
            "aggregate held time",
            f"{result['aggregate_isolated_s']:.1f} s",
            f"{result['aggregate_multi_s']:.1f} s",
            f"-{result['aggregate_time_reduction']:.1%}",
            "-28.3%",
        ]
    ]
    paper = {"train": "20.8% → 41.3% (1.99x)", "infer": "28.1% → 37.5% (1.33x)", "env": "—"}
    for service in SERVICES:
        rows.append(
            [
                f"{service} utilisation",
                f"{result[f'{service}_util_isolated']:.1%}",
                f"{result[f'{service}_util_multi']:.1%}",
                f"{result[f'{service}_util_ratio']:.2f}x",
                paper[service],
            ]
        )
    walls = (result["isolated_wall_s"], result["multi_wall_s"])
    rows.append(["wall time", f"{walls[0]:.1f} s", f"{walls[1]:.1f} s", "", ""])
    cores = (result["cores_in_use_isolated"], result["cores_in_use_multi"])
    rows.append(
        [
            f"cores the work kept busy (of {result['cores']})",
            f"{cores[0]:.2f}",
            f"{cores[1]:.2f}",
            f"{cores[1] / cores[0]:.2f}x",
            "",
        ]
    )
    return rows


def write(
    result: dict[str, Any], phases: dict[str, PhaseRun], sampler: Sampler, path: Path
) -> None:
    """Write the report to ``path`` (its plots embedded) and the plots beside it as PNGs."""
    path.parent.mkdir(parents=True, exist_ok=True)
    pngs = {
        "curves": curves_png(result),
        "utilisation": timeline_png(phases, sampler),
        "aggregate": aggregate_png(result),
    }
    for name, png in pngs.items():
        (path.parent / f"{path.stem}-{name}.png").write_bytes(png)
    tenants = [
        [
            t["name"],
            f"{t['head']} / {t['algorithm']} on {t['target']}",
            f"{t['isolated_completion_s']:.1f} s",
            f"{t['isolated_finish_s']:.1f} s",
            f"{t['multi_completion_s']:.1f} s",
            f"{t['final_metric_name']} {t['final_metric']:.4f}",
            "identical" if t["curves_identical"] else f"max diff {t['curve_max_abs_diff']:.2e}",
        ]
        for t in result["tenants"]
    ]
    breakdown = [
        [
            mode,
            service,
            *(f"{b[k]:.1f}" for k in ("held_s", "busy_s", "overhead_s", "commit_s", "idle_s")),
            f"{b['utilisation']:.1%}",
        ]
        for mode, services in result["time_breakdown"].items()
        for service, b in services.items()
    ]
    wait_rows = [
        [
            mode,
            f"{w['train_batch_wait_ms']:.1f}",
            f"{w['act_round_trip_ms']:.1f}",
            f"{w['act_in_inferencer_ms']:.1f}",
            f"{w['act_forward_ms']:.1f}",
            f"{w['observations_per_forward']:.1f}",
        ]
        for mode, w in result["waits"].items()
    ]
    sim = result.get("simulated", {})
    sim_rows = [
        [name, f"{sim['measured'][name]:.3g}", f"{sim['predicted'][name]:.3g}", f"{err:+.1%}"]
        for name, err in sim.get("relative_error", {}).items()
    ]
    quick = " --quick" if result["quick"] else ""
    body = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>JoyNexus demo report</title>
<style>
body {{ font-family: sans-serif; max-width: 1100px; margin: 2em auto; color: #222; }}
table {{ border-collapse: collapse; margin: 1em 0; }}
td, th {{ border: 1px solid #ccc; padding: 4px 10px; text-align: right; }}
th {{ background: #f3f3f3; }} td:first-child {{ text-align: left; }}
img {{ max-width: 100%; margin: 1em 0; }} code {{ background: #f3f3f3; padding: 1px 4px; }}
</style></head><body>
<h1>JoyNexus: 3 RL tenants + 1 SFT tenant, isolated vs shared</h1>
<p>Each tenant's job ran alone, one after another, holding the whole set of services
(isolated), then all four ran at once on the same set (shared): the same specs and seeds.
Held time is the sum over services of the time they were held; utilisation is the time a
service spent computing over the time it was held. Reproduce: <code>joynexus demo{quick}
--json result.json</code>.</p>
<h2>Headline</h2>
{_table(["", "isolated", "shared", "shared vs isolated", "paper"], headline_rows(result))}
{_img(pngs["aggregate"], "aggregate held time")}
<h2>Tenants</h2>
<p>"alone" is the job's own duration with the services to itself; "queued" adds the jobs
before it (when it finishes if the tenants wait their turn).</p>
{_table(["tenant", "job", "alone", "queued", "shared", "final", "curves"], tenants)}
{_img(pngs["curves"], "learning curves")}
<h2>Utilisation over time</h2>
{_img(pngs["utilisation"], "utilisation timeline")}
<h2>Where the time went</h2>
<p>busy: computing (forward/backward/optimizer, act forwards, simulator steps). overhead:
work in hand but not computing (decoding and normalising, waiting for another service's
answer, batching waits, checkpoint commits). idle: nothing in hand.</p>
{_table(BREAKDOWN_HEADER, breakdown)}
<p>Waits, in milliseconds: an SFT batch from its publish to its step; an act request's round
trip at the env worker, of it the time inside the inferencer (batching wait and forward), and
a batch's forward.</p>
{_table(WAIT_HEADER, wait_rows)}
<h2>The simulator against this run</h2>
<p><code>joynexus simulate --costs {html.escape(str(result.get("costs", "")))}</code> models
the same services and queues with the per-operation costs measured here.</p>
{_table(["metric", "measured", "simulated", "error"], sim_rows)}
</body></html>
"""
    path.write_text(body)
