"""Reference pages generated from the code, so that they cannot drift from it:
``python -m sgl_pd.reference`` writes

- docs/flags.md: every sgl_pd flag of the launcher, with its default and help, from the
  same parser `launch_server` uses;
- docs/environment.md: every environment variable sgl_pd reads or sets
  (`sgl_pd.environment.VARIABLES`);
- docs/metrics.md: every Prometheus series sgl_pd exports, with its type, labels and
  help, from the metric objects a server registers (`backend.metrics`).

The test suite fails when a committed page differs from what this writes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sgl_pd.config import add_cli_args
from sgl_pd.environment import VARIABLES

DOCS = Path(__file__).resolve().parent.parent / "docs"
FLAGS_PAGE = DOCS / "flags.md"
ENVIRONMENT_PAGE = DOCS / "environment.md"
METRICS_PAGE = DOCS / "metrics.md"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "/")


def flags_markdown() -> str:
    parser = argparse.ArgumentParser(add_help=False)
    add_cli_args(parser)
    rows = []
    for action in parser._actions:  # the parser's own record of its flags
        if not action.option_strings:
            continue
        flag = max(action.option_strings, key=len)
        if action.nargs == 0:
            default = "off"
        elif action.default in (None, "", -1, -1.0):
            default = "(none)" if action.default in (None, "") else "derived"
        else:
            default = f"`{action.default}`"
        meaning = (action.help or "").replace("%%", "%")
        if action.choices:
            meaning += " Choices: " + ", ".join(f"`{c}`" for c in action.choices) + "."
        rows.append(f"| `{flag}` | {default} | {_cell(meaning)} |")
    return "\n".join(
        [
            "# sgl_pd's flags",
            "",
            "`python -m sgl_pd.launch_server` takes SGLang's own arguments and these. This page",
            "is generated from the launcher's parser (`python -m sgl_pd.reference`).",
            "",
            "| flag | default | meaning |",
            "|---|---|---|",
            *rows,
            "",
        ]
    )


def environment_markdown() -> str:
    rows = [
        f"| `{v.name}` | {v.owner} | {_cell(v.who_sets)} | {_cell(v.meaning)} |" for v in VARIABLES
    ]
    return "\n".join(
        [
            "# Environment variables",
            "",
            "Every variable sgl_pd reads or sets, generated from `sgl_pd/environment.py`",
            "(`python -m sgl_pd.reference`). sgl_pd's own start with `SGLPD_`, a prefix SGLang",
            "leaves alone; the older `SGL_PD_*` names are still read, with a warning, until the",
            "next release.",
            "",
            "| variable | whose | set by | meaning |",
            "|---|---|---|---|",
            *rows,
            "",
        ]
    )


def metric_families() -> list[tuple[str, str, dict[str, list[str]], str]]:
    """(name, type, label -> its values, help) of every series sgl_pd registers, read
    back from registries holding each side's metrics and the placement counters."""
    from prometheus_client import CollectorRegistry

    from sgl_pd.backend.metrics import PlacementMetrics, TransferMetrics

    families: dict[str, tuple[str, str, dict[str, list[str]], str]] = {}
    for role in ("prefill", "decode"):
        registry = CollectorRegistry()
        TransferMetrics(True, role, registry=registry)
        PlacementMetrics(True, registry=registry)
        for metric in registry.collect():
            name = metric.name + ("_total" if metric.type == "counter" else "")
            _, _, labels, _ = families.setdefault(
                name, (name, metric.type, {}, metric.documentation)
            )
            for sample in metric.samples:
                for label, value in sample.labels.items():
                    if label != "le" and value not in labels.setdefault(label, []):
                        labels[label].append(value)
    return sorted(families.values())


def metrics_markdown() -> str:
    rows = []
    for name, kind, labels, doc in metric_families():
        shown = "; ".join(f"`{label}`: {', '.join(values)}" for label, values in labels.items())
        rows.append(f"| `{name}` | {kind} | {shown} | {_cell(doc)} |")
    return "\n".join(
        [
            "# Metrics",
            "",
            "With SGLang's `--enable-metrics`, a server's `/metrics` carries these besides",
            "SGLang's own, generated from the metric objects a server registers",
            "(`sgl_pd/backend/metrics.py`; `python -m sgl_pd.reference`). Each series is per",
            "scheduler rank, summed by the exposition: a request is counted by every rank",
            "that takes part in it, so plain counts scale with TP while ratios and",
            "quantiles do not. Histograms also export `_bucket`, `_sum` and `_count`. The",
            "placement counters (`sgl_pd_prefill_placement*`, `sgl_pd_local_prefills_total`)",
            "have no `role` label: only decoders place requests.",
            "",
            "| series | type | labels: values | meaning |",
            "|---|---|---|---|",
            *rows,
            "",
        ]
    )


PAGES = {FLAGS_PAGE: flags_markdown, ENVIRONMENT_PAGE: environment_markdown,
         METRICS_PAGE: metrics_markdown}  # fmt: skip


def main() -> int:
    for page, markdown in PAGES.items():
        page.write_text(markdown())
        print(f"wrote {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
