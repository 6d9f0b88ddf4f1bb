"""The extension's report, before and after side by side: `OUT/extension.md` (the verdicts,
the plan with its expected and measured times, the held-out documents per length, loss by
position, the short-context loss, passkey by depth, RULER, each stage), `.json` (all of it,
and each part's status) and `.png` (loss by position at the final length, passkey by depth).
Written again after every part, so a run cut short keeps what it measured.
"""

from __future__ import annotations

from lclm import storage
from lclm.config.syntax import format_tokens
from lclm.eval.report import depth_labels, pyplot, save_png
from lclm.extend.plan import AFTER, BEFORE, TRAIN, YARN, Lengths, Part
from lclm.extend.targets import Measured, Verdict
from lclm.writes import replacing, write_json

COLUMNS = 8  # position ranges per row of the loss tables (the buckets merged)
MODELS = (BEFORE, YARN, AFTER)
NAMES = {BEFORE: "before", YARN: "before + YaRN", AFTER: "after"}


def _minutes(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds:.0f} s" if seconds < 60 else f"{seconds / 60:.1f} min"


def coarse(buckets: list[dict], columns: int = COLUMNS) -> list[float | None]:
    """The mean loss over `columns` equal groups of the buckets (token-weighted)."""
    out: list[float | None] = []
    for g in range(columns):
        group = buckets[g * len(buckets) // columns : (g + 1) * len(buckets) // columns]
        tokens = sum(b["tokens"] for b in group)
        out.append(sum(b["loss"] * b["tokens"] for b in group) / tokens if tokens else None)
    return out


def _cell(x: float | None, digits: int = 4) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _loss_tables(lengths: Lengths, m: Measured) -> list[str]:
    lines = [
        "| length | model | documents | " + " | ".join(depth_labels(COLUMNS)) + " | all |",
        "| --- | --- | --- |" + " --- |" * (COLUMNS + 1),
    ]
    for n in lengths.perplexity:
        for model in MODELS:
            entry = m.perplexity(model, n)
            if entry is None:
                continue
            cells = " | ".join(_cell(x) for x in coarse(entry["buckets"]))
            lines.append(
                f"| {format_tokens(n)} | {NAMES[model]} | {entry['documents']} | "
                f"{cells} | **{entry['loss']:.4f}** |"
            )
    return lines


def _passkey_table(lengths: Lengths, m: Measured) -> list[str]:
    rows = [
        (NAMES[model], acc)
        for model in (BEFORE, AFTER)
        if (acc := m.passkey(model, lengths.final)) is not None
    ]
    if not rows:
        return ["not measured"]
    bins = len(rows[0][1])
    lines = [
        f"| {format_tokens(lengths.final)} | " + " | ".join(depth_labels(bins)) + " | all |",
        "| --- |" + " --- |" * (bins + 1),
    ]
    lines += [
        f"| {name} | " + " | ".join(f"{a:.2f}" for a in acc) + f" | {sum(acc) / len(acc):.2f} |"
        for name, acc in rows
    ]
    return lines


def _ruler_table(lengths: Lengths, m: Measured) -> list[str]:
    found = {
        model: r
        for model in (BEFORE, AFTER)
        if (r := m.report("ruler", model, lengths.final)) is not None
    }
    if not found:
        return ["not measured"]
    tasks = list(next(iter(found.values()))["scores"])
    lines = [
        "| model | " + " | ".join(tasks) + " | average |",
        "| --- |" + " --- |" * (len(tasks) + 1),
    ]
    for model, r in found.items():
        n = lengths.final
        scores = [r["scores"][t].get(str(n), r["scores"][t].get(n)) for t in tasks]
        average = m.ruler(model, n)
        lines.append(
            f"| {NAMES[model]} | "
            + " | ".join(_cell(s, 1) for s in scores)
            + f" | {_cell(average, 1)} |"
        )
    return lines


def _stage_table(parts: list[Part], m: Measured) -> list[str]:
    lines = [
        "| stage | seq_len | loss there, starting weights | loss there, the stage's "
        "weights | after the last stage |",
        "| --- | --- | --- | --- | --- |",
    ]
    train = next(p for p in parts if p.task == TRAIN)
    for i, n in enumerate(train.lengths):
        own = f"stage {i}" if i < len(train.lengths) - 1 else AFTER
        lines.append(
            f"| {i} | {format_tokens(n)} | {_cell(m.loss(BEFORE, n))} | "
            f"{_cell(m.loss(own, n))} | {_cell(m.loss(AFTER, n))} |"
        )
    return lines


def markdown(
    title: str,
    lengths: Lengths,
    parts: list[Part],
    status: dict[str, dict],
    held: dict,
    verdicts: list[Verdict],
    m: Measured,
    command: str,
) -> str:
    short_before, short_after = m.loss(BEFORE, lengths.short), m.loss(AFTER, lengths.short)
    lines = [
        f"# {title}",
        "",
        f"`{command}`",
        "",
        f"The starting weights were trained at {format_tokens(lengths.trained)} tokens; "
        f"the last stage trains at {format_tokens(lengths.final)}.",
        "",
        "## Targets",
        "",
        "| target | measured | verdict |",
        "| --- | --- | --- |",
    ]
    lines += [f"| {v.name} | {v.line} | **{v.word}** |" for v in verdicts]
    if not verdicts:
        lines.append("| (the config sets none) | | |")
    lines += [
        "",
        "## Parts, in the order they run",
        "",
        "| part | expected | took | status |",
        "| --- | --- | --- | --- |",
    ]
    for p in parts:
        s = status.get(p.key, {})
        lines.append(
            f"| {p.what} | {_minutes(s.get('expected'))} ({s.get('how', '')}) | "
            f"{_minutes(s.get('seconds'))} | {s.get('status', 'not run')} |"
        )
    total = sum(s.get("seconds") or 0 for s in status.values())
    lines += [
        "",
        f"Measured so far: {_minutes(total)} in the parts.",
        "",
        "## Held-out documents",
        "",
        f"{held['source']}: {held['read']} documents read, the longest {held['longest']:,} tokens.",
        "",
        "| length | documents of at least length + 1 tokens | used |",
        "| --- | --- | --- |",
    ]
    lines += [
        f"| {format_tokens(int(n))} | {c} | {min(c, held['needed'])} |"
        for n, c in held["counts"].items()
    ]
    lines += [
        "",
        "## Loss by position (mean token loss over equal position ranges)",
        "",
        *_loss_tables(lengths, m),
        "",
        f"## Short-context loss at {format_tokens(lengths.short)}",
        "",
        f"before {_cell(short_before)}, after {_cell(short_after)}"
        + (f" ({short_after / short_before - 1:+.2%})" if short_before and short_after else ""),
        "",
        "## Passkey by depth",
        "",
        *_passkey_table(lengths, m),
        "",
        "## RULER subset",
        "",
        *_ruler_table(lengths, m),
        "",
        "## Stages",
        "",
        *_stage_table(parts, m),
    ]
    return "\n".join(lines)


def draw(path: str, title: str, lengths: Lengths, m: Measured) -> None:
    """Loss against position at the final length (before, with YaRN, after) and passkey
    accuracy by depth (before, after)."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for model in MODELS:
        entry = m.perplexity(model, lengths.final)
        if entry:
            left.plot(
                [(b["lo"] + b["hi"]) / 2 for b in entry["buckets"]],
                [b["loss"] for b in entry["buckets"]],
                label=NAMES[model],
            )
    left.axvline(
        lengths.trained,
        color="grey",
        linestyle="--",
        label=f"trained length {format_tokens(lengths.trained)}",
    )
    left.set_xlabel("token position")
    left.set_ylabel("mean token loss")
    left.set_title(f"loss by position at {format_tokens(lengths.final)}", fontsize=9)
    left.legend(fontsize=8)
    for i, model in enumerate((BEFORE, AFTER)):
        acc = m.passkey(model, lengths.final)
        if acc:
            xs = [b + (i - 0.5) * 0.4 for b in range(len(acc))]
            right.bar(xs, acc, width=0.4, label=NAMES[model])
    bins = len(m.passkey(AFTER, lengths.final) or m.passkey(BEFORE, lengths.final) or [])
    right.set_xticks(range(bins), depth_labels(bins))
    right.set_ylim(0, 1.05)
    right.set_xlabel("depth of the passkey")
    right.set_ylabel("passkey accuracy")
    right.set_title(f"passkey at {format_tokens(lengths.final)}", fontsize=9)
    if right.get_legend_handles_labels()[0]:
        right.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    save_png(path, fig)


def write(
    out: str,
    title: str,
    lengths: Lengths,
    parts: list[Part],
    status: dict[str, dict],
    held: dict,
    verdicts: list[Verdict],
    m: Measured,
    command: str,
    meta: dict,
) -> None:
    """OUT/extension.{md,json,png}, each replaced atomically."""
    storage.makedirs(out)
    with replacing(storage.join(out, "extension.md")) as f:
        f.write(markdown(title, lengths, parts, status, held, verdicts, m, command) + "\n")
    write_json(
        storage.join(out, "extension.json"),
        dict(
            meta,
            command=command,
            lengths=dict(
                trained=lengths.trained,
                final=lengths.final,
                perplexity=list(lengths.perplexity),
                short=lengths.short,
                near=list(lengths.near),
                far=list(lengths.far),
            ),
            heldout=held,
            parts=[
                dict(
                    key=p.key,
                    task=p.task,
                    model=p.model,
                    lengths=list(p.lengths),
                    **status.get(p.key, {}),
                )
                for p in parts
            ],
            verdicts=[dict(target=v.name, met=v.met, measured=v.line) for v in verdicts],
            results={
                model: {str(n): m.loss(model, n) for n in lengths.perplexity} for model in MODELS
            },
        ),
    )
    draw(storage.join(out, "extension.png"), title, lengths, m)
