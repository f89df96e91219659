"""`runs/<name>/report.md`: what each stage did and cost, the loss curves, and the evaluation table."""

from __future__ import annotations

import json
from pathlib import Path

from amalia_ray.core import secrets
from amalia_ray.core.formats.step_metrics import read_step_records
from amalia_ray.pipeline.accounting import total_cost
from amalia_ray.pipeline.manifest import Manifest


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def _table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(_fmt(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


# One panel per kind of objective, each on its own axes: pretraining's and SFT's cross-entropy share a unit; DPO's
# loss and GRPO's rewards mean other things. Each: (title, left series, its label, right series, its label).
LOSS_PANELS = {
    "cross-entropy": ("pretrain / SFT", "loss", "cross-entropy (nats/token)", None, None),
    "dpo": ("DPO", "loss", "DPO loss (−log σ(β·margin), per pair)", "rewards/margins", "reward margin (β·log-ratio)"),
    "grpo": ("GRPO", "reward", "mean reward", "kl", "KL to the reference (nats/token)"),
    "reward": ("reward model", "loss", "Bradley–Terry loss (−log σ(r_chosen − r_rejected), per pair)", "accuracy",
               "pairs ranked right"),
}


def loss_panel_of(objective: str | None, history: list[dict]) -> str:
    """The panel a stage's curve goes on: its objective's (the registry's `loss_panel`), or (a stage the recipe no
    longer has) by what it logged."""
    if objective is not None:
        from amalia_ray.train.objectives.registry import objective_of

        return objective_of(objective).loss_panel
    if history:
        first = history[0]
        return ("dpo" if "rewards/margins" in first else "grpo" if "reward" in first
                else "reward" if "mean_reward" in first else "cross-entropy")
    return "cross-entropy"


def plot_losses(run_dir: Path, train_stages: list[str], objectives: dict[str, str] | None = None) -> Path | None:
    """`loss.png`: one panel per kind of objective (LOSS_PANELS), each stage's curve against its own optimizer
    steps, validation points where the stage has them. The panels and their axis labels are also written into the
    PNG's metadata (key "Panels", JSON), so a reader or a test can tell what was drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves: dict[str, list[tuple[str, list[dict]]]] = {}
    for name in train_stages:
        if history := read_step_records(run_dir / name / "metrics.jsonl"):
            panel = loss_panel_of((objectives or {}).get(name), history)
            curves.setdefault(panel, []).append((name, history))
    if not curves:
        return None
    panels = [k for k in LOSS_PANELS if k in curves]
    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 3.2 * len(panels)), squeeze=False)
    described = []
    for ax, panel in zip(axes[:, 0], panels):
        title, left, left_label, right, right_label = LOSS_PANELS[panel]
        twin = ax.twinx() if right and any(right in h for _, stage in curves[panel] for h in stage) else None
        for name, history in curves[panel]:
            line, = ax.plot([h["step"] for h in history if left in h], [h[left] for h in history if left in h],
                            label=f"{name} {left}" if twin else f"{name} train")
            val = [(h["step"], h["val_loss"]) for h in history if h.get("val_loss") is not None]
            if val and left == "loss":
                ax.plot(*zip(*val), "o--", label=f"{name} validation")
            if twin:
                twin.plot([h["step"] for h in history if right in h], [h[right] for h in history if right in h],
                          ":", color=line.get_color(), label=f"{name} {right} (right axis)")
        ax.set_title(f"{title} — {run_dir.name}", fontsize=10)
        ax.set_xlabel("optimizer step of the stage")
        ax.set_ylabel(left_label)
        ax.grid(alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        if twin:
            twin.set_ylabel(right_label)
            more = twin.get_legend_handles_labels()
            handles, labels = handles + more[0], labels + more[1]
        ax.legend(handles, labels, fontsize="small")
        described.append({"panel": panel, "ylabel": left_label, **({"ylabel_right": right_label} if twin else {}),
                          "stages": [name for name, _ in curves[panel]]})
    out = run_dir / "loss.png"
    fig.tight_layout()
    fig.savefig(out, dpi=110, metadata={"Panels": json.dumps(described)})
    plt.close(fig)
    return out


def _split(results: dict) -> tuple[list[str], list[str]]:
    models = list(dict.fromkeys(k.split("/", 1)[0] for k in results))
    tasks = list(dict.fromkeys(k.split("/", 1)[1] for k in results))
    return models, tasks


def _first(results: dict, models: list[str], task: str) -> dict:
    """The task's first scored row (a model that could not be served has a row that says why, and no scores)."""
    rows = [results[f"{m}/{task}"] for m in models if f"{m}/{task}" in results]
    return next((row for row in rows if "failed" not in row), rows[0])


def _headline(r: dict) -> tuple[str, float | None, float | None]:
    """The task's headline metric, its value and standard error (NaN stderr, e.g. n = 1, reads as none)."""
    metric = r.get("metric", "acc")
    se = r.get(f"{metric}_stderr")
    return metric, r.get(metric), se if se == se else None


def evaluation_section(run_dir: Path, metrics: dict) -> list[str]:
    """One row per task, one column per checkpoint (the base model when there is one, then the run's stages in
    order): its headline score ± stderr, and each stage's change against the base model — a LoRA adapter's against
    the checkpoint it was trained from, whose engine served it."""
    results, base, adapters = metrics["results"], metrics.get("base_model"), metrics.get("adapters") or {}
    models, tasks = _split(results)
    reference = {m: adapters.get(m) or (base if m != base else None) for m in models}
    rows = []
    for task in tasks:
        first = _first(results, models, task)
        metric = _headline(first)[0]
        cells = []
        for m in models:
            _, value, se = _headline(results.get(f"{m}/{task}", {}))
            cell = "" if value is None else f"{value:.3f}" + (f" ± {se:.3f}" if se is not None else "")
            if "failed" in results.get(f"{m}/{task}", {}):
                cell = "not served (below)"
            ref_value = _headline(results.get(f"{reference[m]}/{task}", {}))[1] if reference[m] else None
            if value is not None and ref_value is not None:
                cell += f" ({value - ref_value:+.3f})"
            cells.append(cell)
        rows.append([task, metric, *cells, first.get("chance"), first.get("n")])
    against = [f"each stage's change against the base model {base}"] if base else []
    against += ["each LoRA adapter's (MODEL:ADAPTER) against the checkpoint it was trained from"] if adapters else []
    on = ", ".join(f"{a} on {m}" for a, m in adapters.items())
    parts = ["## Evaluation", "", f"Served at {metrics.get('base_url')} with Ray Serve + vLLM; scored over HTTP "
             f"(mean ± standard error{'; in brackets ' + ' and '.join(against) if against else ''}).", ""]
    if adapters:
        parts += [f"LoRA adapters, each served on the engine of the checkpoint it was trained from (no engine of "
                  f"its own): {on}.", ""]
    parts += [_table(["task", "metric", *models, "chance", "n"], rows), ""]
    if failed := {m: row["failed"] for key, row in results.items() if "failed" in row for m in [key.split("/")[0]]}:
        parts += ["Not scored: the server could not run these models (each failed its first request):", "",
                  *[f"- {m}: {why}" for m, why in failed.items()], ""]
    if any("n_seen" in r for r in results.values()):
        clean_rows = []
        for task in tasks:
            first = _first(results, models, task)
            metric = _headline(first)[0]
            clean_rows.append([task, first.get("n_seen"), *[results.get(f"{m}/{task}", {}).get(f"{metric}_clean")
                                                            for m in models]])
        parts += ["Items seen in the training text (eval.contamination_of) and each checkpoint's score on the "
                  "unseen items:", "", _table(["task", "items seen", *models], clean_rows), ""]
    png = plot_evaluation(run_dir, results, base)
    if png:
        parts += [f"![evaluation]({png.name})", ""]
    return parts


def plot_evaluation(run_dir: Path, results: dict, base: str | None = None) -> Path | None:
    """Scores per task and checkpoint; with a base model, a second panel of each stage's change against it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models, tasks = _split(results)
    base = base if base in models else None
    panels = 2 if base and len(models) > 1 else 1
    width_in = max(5, 1.6 * len(tasks) * max(1, len(models)) / 2)
    fig, axes = plt.subplots(panels, 1, figsize=(width_in, 4 * panels), squeeze=False)
    labels = [f"{t}\n({_headline(_first(results, models, t))[0]})" for t in tasks]

    def bars(ax, series: list[str], value_of, ylabel: str) -> None:
        width = 0.8 / len(series)
        for i, m in enumerate(series):
            values = [value_of(m, t) for t in tasks]
            errors = [se or 0.0 for _, se in values] if any(se for _, se in values) else None
            ax.bar([j + i * width for j in range(len(tasks))], [float("nan") if v is None else v for v, _ in values],
                   width,
                   yerr=errors, capsize=3, label=m)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(tasks))], labels)
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize="small")

    bars(axes[0][0], models, lambda m, t: _headline(results.get(f"{m}/{t}", {}))[1:], "score")
    axes[0][0].set_title(f"Evaluation — {run_dir.name}")
    if panels == 2:
        def change(m, t):
            value, base_value = (_headline(results.get(f"{x}/{t}", {}))[1] for x in (m, base))
            return (value - base_value if value is not None and base_value is not None else None), None

        bars(axes[1][0], [m for m in models if m != base], change, f"change against {base}")
        axes[1][0].axhline(0, color="black", linewidth=0.8)
    out = run_dir / "eval.png"
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def cost_section(manifest: Manifest) -> list[str]:
    """Device-hours held, tokens, energy and money per stage (failed attempts included), with the run's total."""
    rows, costs = [], []
    for name, rec in manifest.stages.items():
        if not rec.cost:
            continue
        c = rec.cost
        spent = total_cost([rec.earlier_attempts_cost, c]) if rec.earlier_attempts_cost else c
        costs.append(spent)
        hours, per_hour = spent["device_hours"], c.get("tokens_per_device_hour", {})
        rows.append([name, hours.get("CPU"), hours.get("GPU"), c.get("tokens"), per_hour.get("GPU"),
                     per_hour.get("CPU"), spent["energy_kwh"] * 1000, c.get("tokens_per_joule"), spent["usd"]])
    if not rows:
        return []
    total = total_cost(costs)
    rows.append(["**total**", total["device_hours"].get("CPU"), total["device_hours"].get("GPU"), None, None, None,
                 total["energy_kwh"] * 1000, None, total["usd"]])
    a = manifest.accounting or {}
    return ["## Cost", "", "Device-hours are what each stage held (CPUs, GPUs) times its wall time, failed attempts "
            "included; energy and money follow from "
            + ", ".join(f"{w:g} W" + f" and ${a.get('usd_per_hour', {}).get(k, 0):g}/h per {k}"
                        for k, w in a.get("watts", {}).items())
            + f" at PUE {a.get('pue', 1):g} (recipe `accounting:`). Tokens: packed (pack), trained on (training "
            "stages), prompt + completion as the server counted them (eval).", "",
            _table(["stage", "CPU-hours", "GPU-hours", "tokens", "tokens/GPU-hour", "tokens/CPU-hour", "energy (Wh)",
                    "tokens/J", "USD"], rows), ""]


def _sweep_table(summary: dict) -> str:
    params = list(summary["space"]["parameters"])
    benched = [t["benchmark"] for t in summary["trials"] if t.get("benchmark")]
    bench = next((b for b in benched if "metric" in b), benched[0] if benched else None)

    def scored(t: dict):  # a trial the server could not run says why
        b = t.get("benchmark", {})
        return f"not served ({b['failed']})" if "failed" in b else b.get("value")

    rows = [[t["trial_id"], *(t["config"].get(k) for k in params), t["metric"], t["best_metric"], t["steps"],
             t["status"] + (" (best)" if t["trial_id"] == summary["best"]["trial_id"] else ""),
             *([scored(t)] if bench else [])]
            for t in summary["trials"]]
    return _table(["trial", *params, f"{summary['metric']} (last)", f"{summary['metric']} (best)", "steps", "status",
                   *([f"{bench['task']} {bench.get('metric', '')}".strip()] if bench else [])], rows)


def plot_sweep(sweep_dir: Path, summary: dict) -> Path | None:
    """The metric each trial ended on against each swept value (log axis for log-uniform draws)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    params = summary["space"]["parameters"]
    trials = [t for t in summary["trials"] if t["metric"] is not None]
    if not trials:
        return None
    fig, axes = plt.subplots(1, len(params), figsize=(4 * len(params), 3.5), squeeze=False)
    for ax, (name, spec) in zip(axes[0], params.items()):
        values = [t["config"][name] for t in trials]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            xs = values
            if spec.get("distribution") == "loguniform":
                ax.set_xscale("log")
        else:
            labels = list(dict.fromkeys(map(str, values)))
            xs = [labels.index(str(v)) for v in values]
            ax.set_xticks(range(len(labels)), labels)
        colours = ["tab:green" if t["status"] == "completed" else "tab:red" for t in trials]
        ax.scatter(xs, [t["metric"] for t in trials], c=colours)
        ax.set_xlabel(name)
        ax.set_ylabel(summary["metric"])
        ax.grid(alpha=0.3)
    fig.suptitle(f"Sweep {summary['sweep_id']} (green: ran to the end, red: stopped early or failed)", fontsize=9)
    out = sweep_dir / "sweep.png"
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def write_sweep_report(sweep_dir: Path, summary: dict) -> Path:
    best, proxy = summary["best"], summary["proxy"]
    png = plot_sweep(sweep_dir, summary)
    parts = [f"# Sweep {summary['sweep_id']}: stage {summary['stage']} of run {summary['run']}", "",
             f"Proxy: {proxy['steps']} steps, validation every {proxy['validate_every']}, "
             f"{proxy['num_workers']} worker(s), model overrides {proxy['model'] or 'none'}.", "",
             f"Best ({summary['mode']} {summary['metric']}): {best['config']} → {best['metric']:.4g} "
             f"(trial {best['trial_id']}). `amalia promote {sweep_dir}` writes it into a full-scale recipe.", "",
             _sweep_table(summary), ""] + ([f"![sweep]({png.name})", ""] if png else [])
    if any(t.get("benchmark", {}).get("one_engine") for t in summary["trials"]):
        parts += ["The benchmarked trials' LoRA adapters were served together on one engine of the stage's starting "
                  "checkpoint (model ids base:trial-ID).", ""]
    out = sweep_dir / "report.md"
    out.write_text("\n".join(parts), encoding="utf-8")
    return out


def sweeps_section(run_dir: Path) -> list[str]:
    parts = []
    for info in sorted((run_dir / "sweeps").glob("*/sweep.json")):
        summary = json.loads(info.read_text(encoding="utf-8"))
        best = summary["best"]
        parts += [f"### {summary['sweep_id']} (stage {summary['stage']})", "",
                  f"Best {summary['metric']} {best['metric']:.4g} with {best['config']}.", "", _sweep_table(summary), ""]
        if (info.parent / "sweep.png").exists():
            parts += [f"![sweep](sweeps/{info.parent.name}/sweep.png)", ""]
    return ["## Sweeps", "", *parts] if parts else []


def write_report(run_dir: Path, manifest: Manifest, objectives: dict[str, str] | None = None) -> Path:
    """`objectives`: each training stage's objective (which loss panel its curve goes on)."""
    stages = manifest.stages
    # stages with a step recorded (an attempt restarted from no checkpoint and stopped before its first has none)
    train_stages = [n for n in stages if read_step_records(run_dir / n / "metrics.jsonl")]
    parts = [f"# Run report: {manifest.run_name}", "", f"Recipe: `{manifest.recipe_path}` (hash {manifest.recipe_hash})", ""]
    for prov in manifest.provenance:
        parts += [f"Promoted from sweep {prov.get('sweep_id')}: stage {prov.get('stage')} takes {prov.get('values')} "
                  f"({prov.get('metric')} on a proxy of {prov.get('proxy', {}).get('steps')} steps, "
                  f"{prov.get('trials')} trials).", ""]

    parts += ["## Stages", "", _table(
        ["stage", "status", "wall time (s)", "attempts", "resources", "code version"],
        [[n, r.status + (" (stale, reused)" if r.reused_stale else ""), r.wall_time_s, r.attempts,
          ", ".join(f"{k}={v}" for k, v in r.resources.items()), f"{r.code_version} ({r.code_hash})" if r.code_hash
          else r.code_version] for n, r in stages.items()],
    ), ""]
    if stale := [n for n, r in stages.items() if r.reused_stale]:
        parts += [f"Reused on purpose (--reuse-stale) although the code has changed since they ran: "
                  f"{', '.join(stale)}; rerun them without it to get this code's results.", ""]

    data = stages.get("data")
    if data and data.metrics.get("per_filter"):
        m = data.metrics
        parts += ["## Data", "", f"{m['documents_in']} documents read, {m['documents_after_filters']} passed the "
                  f"filters, {m['exact_duplicates_removed']} exact and {m.get('near_duplicates_removed', 0)} near "
                  f"duplicates removed, {m['documents_kept']} kept.", "",
                  _table(["source", "outcome", "documents"],
                         [[r["source"], r["reason"], r["documents"]] for r in sorted(
                             m["per_filter"], key=lambda r: (r["source"], r["reason"]))]), ""]
        if m.get("shuffled"):
            moved = m["shuffled"]
            parts += [f"Shuffles: {moved['exchanges']} keyed exchanges moved {moved['bytes'] / 1e6:,.1f} MB of keys "
                      f"in {moved['objects']:,} Ray objects (the largest part {moved['largest_part_bytes'] / 1e6:,.1f} "
                      "MB); the documents' text was not shuffled.", ""]
        if m.get("kept_by_variety"):
            parts += ["Kept documents by Portuguese variety: "
                      + ", ".join(f"{k} {v}" for k, v in sorted(m["kept_by_variety"].items())) + ".", ""]
        if m.get("contamination"):
            parts += ["Benchmark decontamination (word n-gram overlap with each task's items):", "",
                      _table(["task", "items", "items checked", "items overlapping", "documents overlapping"],
                             [[t, c["items"], c["items_checked"], c["items_overlapping"], c["documents_overlapping"]]
                              for t, c in sorted(m["contamination"].items())]), ""]
    pack = stages.get("pack")
    if pack and pack.metrics:
        parts += [f"Packed: {pack.metrics.get('train_sequences')} training and "
                  f"{pack.metrics.get('validation_sequences')} validation sequences of {pack.metrics.get('seq_len')} "
                  "tokens.", ""]

    if train_stages:
        rows = []
        for n in train_stages:
            history = read_step_records(run_dir / n / "metrics.jsonl")
            vals = [h["val_loss"] for h in history if h.get("val_loss") is not None]
            steady = history[1:] or history  # the first step of an attempt waits for start-up work
            tps = [h["tokens_per_s"] for h in steady if h.get("tokens_per_s") is not None]
            mfu = [h["mfu"] for h in steady if h.get("mfu") is not None]
            m = stages[n].metrics
            placed = ", ".join(str(m[k]) for k in ("worker_layout", "placement", "sharding", "transport")
                               if m.get(k)) if m.get("worker_layout") else None
            rows.append([n, len(history), history[0].get("loss"), history[-1].get("loss"), vals[-1] if vals else None,
                         sum(h.get("tokens", 0) for h in history), sum(tps) / len(tps) if tps else None,
                         f"{sum(mfu) / len(mfu):.0%}" if mfu else None, placed])
        parts += ["## Training", "", _table(
            ["stage", "steps", "first loss", "last loss", "validation loss", "tokens", "tokens/s (mean)",
             "MFU (mean)", "workers (placement, sharding, network)"], rows), ""]
        bases = sorted({h["peak_basis"] for n in train_stages for h in read_step_records(run_dir / n / "metrics.jsonl")
                        if h.get("peak_basis")})
        if bases:
            parts += ["MFU counts model FLOPs (6 × matmul parameters + 12 · layers · attention width · sequence per "
                      "token, as torchtitan) against each worker's peak: " + "; ".join(bases) + ".", ""]
        png = plot_losses(run_dir, train_stages, objectives)
        if png:
            parts += [f"![loss curve]({png.name})", ""]

    parts += cost_section(manifest)
    parts += sweeps_section(run_dir)

    ev = stages.get("eval")
    if ev and ev.metrics.get("results"):
        parts += evaluation_section(run_dir, ev.metrics)

    out = run_dir / "report.md"
    out.write_text(secrets.mask("\n".join(parts)), encoding="utf-8")  # stage metrics may quote what they were given
    return out
