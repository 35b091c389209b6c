"""The Grafana dashboard (deploy/grafana/pdcluster.json) drawn without
Grafana: every panel's queries run through a Prometheus's range API and
plotted on one PNG, a panel per subplot.  For docs/operating.md and for a quick
look where no Grafana runs:

    python -m pdcluster.observability.dashboard_plot --prometheus http://127.0.0.1:9090 \\
        --model SmolLM2-135M-Instruct --minutes 10 --out dashboard.png
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "pdcluster.json"


def expr_for_prometheus(expr: str, model: str, rate_interval: str = "1m") -> str:
    """A panel's PromQL with Grafana's variables filled in."""
    return expr.replace("$__rate_interval", rate_interval).replace("$model_name", model)


def query_range(prometheus: str, expr: str, start_s: float, end_s: float, step_s: float) -> list[dict]:
    import httpx

    r = httpx.get(f"{prometheus}/api/v1/query_range",
                  params={"query": expr, "start": start_s, "end": end_s, "step": step_s}, timeout=30)
    r.raise_for_status()
    return r.json()["data"]["result"]


def legend(fmt: str, labels: dict) -> str:
    out = fmt
    for key, value in labels.items():
        out = out.replace("{{" + key + "}}", value)
    return out


def render(prometheus: str, out: Path, model: str, minutes: float = 10.0, dashboard: Path = DASHBOARD) -> int:
    """Draws every panel; returns how many series were drawn."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = json.loads(dashboard.read_text())["panels"]
    end = time.time()
    start, step = end - minutes * 60, max(1.0, minutes * 60 / 300)
    cols = 2
    fig, axes = plt.subplots(math.ceil(len(panels) / cols), cols, figsize=(14, 3 * math.ceil(len(panels) / cols)))
    drawn = 0
    for ax, panel in zip(axes.flat, panels):
        for target in panel["targets"]:
            for series in query_range(prometheus, expr_for_prometheus(target["expr"], model), start, end, step):
                xs = [float(t) - end for t, _ in series["values"]]
                ys = [float(v) for _, v in series["values"]]
                ax.plot(xs, ys, label=legend(target.get("legendFormat", ""), series["metric"]) or None)
                drawn += 1
        ax.set_title(f'{panel["title"]} ({panel["fieldConfig"]["defaults"].get("unit", "")})', fontsize=9)
        ax.tick_params(labelsize=7)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6, loc="upper left")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.supxlabel("seconds before now", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return drawn


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prometheus", required=True, help="http://HOST:PORT of a Prometheus scraping the gateway")
    p.add_argument("--model", default="SmolLM2-135M-Instruct", help="the served model name ($model_name)")
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--out", type=Path, default=Path("dashboard.png"))
    args = p.parse_args()
    print(f"{render(args.prometheus, args.out, args.model, args.minutes)} series drawn to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
