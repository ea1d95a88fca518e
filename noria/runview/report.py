"""``noria report RUN_DIR``: one self-contained HTML page of a run's curves, plus the curves as PNG files.

Reads what ``noria train`` (RL) writes into its run folder (``noria.metrics``): ``config.yaml``,
``metrics.jsonl``, ``eval.jsonl`` and ``rollouts/step-*.jsonl``; a run still in progress can be
reported (a half-written last line is ignored). Writes ``RUN_DIR/report/report.html`` (every plot
embedded as a PNG data URI, so the page is one file that opens offline) and one PNG per plot next
to it (``reward.png``, ``kl_entropy.png``, ...).

Plots of an RL run (``FIGURES``, in page order): reward and held-out accuracy; loss and policy
loss; gradient norm and learning rate; clip fraction; response length and truncation; zero-variance
groups; KL and entropy; rollout-vs-trainer logprob difference; tokens/s; peak memory; stage timings (evaluation
included); buffer size and staleness; weight-sync time. An SFT run (``train.algorithm: sft``) gets
its own page (``SFT_FIGURES``: loss, gradient norm and learning rate, tokens/s), and so does a reward
model (``train.algorithm: reward_model``; ``RM_FIGURES``: pairwise loss, pair accuracy and margin on
the step's pairs and on the held-out ones, gradient norm and learning rate, tokens/s). A plot whose
metrics the run did not record says so inside its frame instead of disappearing, so the page
always has the same plots. A curve whose values are all zero within float rounding is drawn flat
at 0 with a note, not as a trend of noise. A resumed run is one curve: every step it resumed from is a
dashed line on every plot over steps, and the summary lists each segment of the run (each start of
``noria train`` on the folder: where it started, the steps it recorded, what a resume moved to
``superseded/``) and the earlier runs a ``--restart`` moved into ``previous-<time>/``
(``noria.runview.segments``). Matplotlib renders (Agg backend, no display needed).

Not shown: per-token data (``noria inspect``).
"""

from __future__ import annotations

import base64
import html
import io
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from noria.errors import NoriaError
from noria.metric_names import metric_doc
from noria.metrics import read_jsonl
from noria.runview.segments import run_segments, summary_lines


@dataclass
class RunData:
    """A run folder's records, read once."""

    folder: Path
    config_text: str
    config: dict[str, Any]
    steps: list[dict[str, Any]]
    evals: list[dict[str, Any]]
    sampled_nll: dict[int, float]
    """step -> mean of -logprob over the step's sampled policy tokens (an entropy estimate)."""
    lengths: dict[int, tuple[float, int]]
    """step -> (mean, max) response length in tokens of the step's sampled trajectories."""
    resumed_at: list[int]
    """Steps a resumed run picked up from (``resumed`` events of ``events.jsonl``: ``noria.runview.segments``)."""
    segments: list[str] = field(default_factory=list)
    """One line per segment of the run, then per earlier run moved aside (``noria.runview.segments.summary_lines``)."""

    @property
    def algorithm(self) -> str:
        """``train.algorithm`` of the run: rl, sft or reward_model."""
        return algorithm_of(self.config)

    @property
    def sft(self) -> bool:
        return self.algorithm == "sft"

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of ``key`` over the rows that have a finite number for it."""
        xs, ys = [], []
        for row in self.steps:
            value = row.get(key)
            if _finite(value):
                xs.append(int(row["step"]))
                ys.append(float(value))
        return xs, ys

    def derived(self, fn: Callable[[dict[str, Any]], float | None]) -> tuple[list[int], list[float]]:
        xs, ys = [], []
        for row in self.steps:
            value = fn(row)
            if _finite(value):
                xs.append(int(row["step"]))
                ys.append(float(value))
        return xs, ys


def load_run(folder: str | Path) -> RunData:
    import yaml

    folder = Path(folder)
    if not (folder / "metrics.jsonl").is_file():
        raise NoriaError(f"{folder}: no metrics.jsonl here; pass the run folder of `noria train`")
    config_path = folder / "config.yaml"
    config_text = config_path.read_text() if config_path.is_file() else ""
    config = (yaml.safe_load(config_text) or {}) if config_text else {}
    rows = read_jsonl(folder / "metrics.jsonl")
    steps = [r for r in rows if "step" in r]
    numbers = [int(r["step"]) for r in steps if _finite(r.get("step"))]
    resumed = sorted({s.at_step for s in run_segments(folder, numbers) if s.event == "resumed"})
    evals = measured_evals(read_jsonl(folder / "eval.jsonl"), score_key(algorithm_of(config)))
    nll, lengths = rollout_stats(folder)
    return RunData(folder, config_text, config, steps, evals, nll, lengths, resumed, summary_lines(folder, numbers))


def rollout_stats(folder: Path) -> tuple[dict[int, float], dict[int, tuple[float, int]]]:
    """From ``rollouts/step-*.jsonl``, per step: the mean -logprob of the sampled policy tokens (a
    Monte Carlo estimate of the sampling distribution's entropy, E[-log p(x)] with x ~ p, available
    even when the trainer logs none), and the (mean, max) response length in tokens."""
    nll, lengths = {}, {}
    for path in sorted((folder / "rollouts").glob("step-*.jsonl")):
        step = int(path.stem.split("-")[1])
        total, count, sizes = 0.0, 0, []
        for rec in read_jsonl(path):
            sizes.append(len(rec.get("token_ids") or []))
            for lp, m in zip(rec.get("logprobs") or [], rec.get("loss_mask") or []):
                if m and _finite(lp):
                    total -= lp
                    count += 1
        if count:
            nll[step] = total / count
        if sizes:
            lengths[step] = (sum(sizes) / len(sizes), max(sizes))
    return nll, lengths


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# ---------------------------------------------------------------------------------------- figures


@dataclass(frozen=True)
class Figure:
    slug: str
    title: str
    caption: str
    keys: tuple[str, ...]
    draw: Callable[[RunData, Any], None]


FIGURES: list[Figure] = []
"""The RL page's plots, in page order."""
SFT_FIGURES: list[Figure] = []
"""The SFT page's plots."""
RM_FIGURES: list[Figure] = []
"""A reward model's page's plots."""


def figure(slug: str, title: str, caption: str, keys: tuple[str, ...], into: list[Figure] = FIGURES) -> Callable:
    def register(draw: Callable[[RunData, Any], None]) -> Callable:
        into.append(Figure(slug, title, caption, keys, draw))
        return draw

    return register


def figures_of(run: RunData) -> list[Figure]:
    return {"sft": SFT_FIGURES, "reward_model": RM_FIGURES}.get(run.algorithm, FIGURES)


ROUNDING_ZERO = 1e-7
"""A curve whose every |value| is below this is float noise around 0 (e.g. a GRPO loss whose
advantages cancel), drawn flat at 0 with a note instead of autoscaled into a fake trend."""


def lines(ax: Any, curves: list[tuple[str, tuple[list[int], list[float]]]], ylabel: str, missing: str) -> bool:
    """Plot the non-empty curves on ``ax``; if none has data, write ``missing`` in the frame."""
    drawn, noise = False, []
    for label, (xs, ys) in curves:
        if xs:
            if all(abs(y) < ROUNDING_ZERO for y in ys):
                noise.append(f"{label}: 0 within rounding (|max| {max(abs(y) for y in ys):.1g})")
                ys = [0.0] * len(ys)
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=label)
            drawn = True
    if noise:
        ax.text(0.01, 0.97, "\n".join(noise), transform=ax.transAxes, va="top", fontsize=8, color="#555")
    steps_axis(ax)
    mark_resumes(ax)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if drawn:
        ax.legend(fontsize=8)
    else:
        empty(ax, missing)
    return drawn


_RESUMES: list[int] = []
"""Restart steps of the run being drawn (set by :func:`render_png`): drawn on every step axis."""


def mark_resumes(ax: Any) -> None:
    for i, step in enumerate(_RESUMES):
        ax.axvline(step + 0.5, color="#999", linestyle="--", linewidth=1, label="resumed" if i == 0 else None)


def steps_axis(ax: Any) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def empty(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=9, color="#555", wrap=True)


@figure("reward", "Reward and held-out accuracy", "Mean rollout reward per step (training prompts, sampled) and "
        "accuracy on the held-out split (greedy evaluation, eval.jsonl) plotted at the step whose weights it measured "
        "(with eval.mode fleet or checkpoint the score arrives eval/lag_steps later; rows marked invalid are left out).",
        ("rollout/reward_mean", "eval/accuracy"))  # fmt: skip
def _reward(run: RunData, fig: Any) -> None:
    ax = fig.add_subplot()
    curves = [("rollout reward (mean)", run.series("rollout/reward_mean"))]
    curves.append(("held-out accuracy", ([int(r["step"]) for r in run.evals], [float(r["accuracy"]) for r in run.evals])))
    lines(ax, curves, "reward / accuracy", "no reward recorded yet")


@figure("loss", "Loss", "The step's total loss (policy term plus KL and entropy terms) and the policy-gradient term "
        "alone, normalised over trained tokens. GRPO's loss hovers near 0 by construction (advantages are centred); "
        "read it with the reward, not as a learning curve.", ("loss", "policy_loss"))  # fmt: skip
def _loss(run: RunData, fig: Any) -> None:
    lines(fig.add_subplot(), [("loss", run.series("loss")), ("policy loss", run.series("policy_loss"))], "loss", "no loss recorded")


@figure("grad_lr", "Gradient norm and learning rate", "Global gradient L2 norm before clipping (left) and the learning "
        "rate of the step's last optimizer step (right).", ("grad_norm", "lr"))  # fmt: skip
def _grad_lr(run: RunData, fig: Any) -> None:
    left, right = fig.subplots(1, 2)
    lines(left, [("grad norm", run.series("grad_norm"))], "L2 norm", "no gradient norm recorded")
    lines(right, [("learning rate", run.series("lr"))], "lr", "no learning rate recorded")


@figure("clip", "Clip fraction", "Trained tokens whose importance ratio the policy loss clipped (and, for ppo_clip, "
        "those dual-clip caught). Near 0 on-policy; it rises with staleness or large updates.",
        ("clip_frac", "dual_clip_frac"))  # fmt: skip
def _clip(run: RunData, fig: Any) -> None:
    curves = [("clip fraction", run.series("clip_frac")), ("dual-clip fraction", run.series("dual_clip_frac"))]
    lines(fig.add_subplot(), curves, "fraction of tokens", "no clip fraction recorded")


@figure("responses", "Response length and truncation", "Left: mean and longest response of each step in tokens "
        "(rollouts/). Right: samples cut at rollout.max_new_tokens, and groups whose samples all got the same reward "
        "(no GRPO signal).", ("rollout/response_len_mean", "rollout/truncated_frac", "rollout/groups_zero_variance_frac"))  # fmt: skip
def _responses(run: RunData, fig: Any) -> None:
    left, right = fig.subplots(1, 2)
    steps = sorted(run.lengths)
    mean = (steps, [run.lengths[s][0] for s in steps]) if steps else run.series("rollout/response_len_mean")
    longest = (steps, [float(run.lengths[s][1]) for s in steps])
    lines(left, [("mean", mean), ("max", longest)], "tokens", "no response lengths recorded")
    fractions = [("truncated", run.series("rollout/truncated_frac")),
                 ("zero-variance groups", run.series("rollout/groups_zero_variance_frac"))]  # fmt: skip
    if lines(right, fractions, "fraction", "no truncation recorded"):
        right.set_ylim(-0.05, 1.05)


@figure("kl_entropy", "KL and entropy", "Left: KL estimates (rollout engine vs trainer; old vs current policy; "
        "vs the reference model when train.loss.kl_coef > 0). Right: entropy: the trainer's (logged when "
        "train.loss.entropy_coef > 0) and the mean -logprob of the sampled tokens (rollouts/), an estimate of it.",
        ("rollout_kl", "approx_kl", "ref_kl", "entropy"))  # fmt: skip
def _kl_entropy(run: RunData, fig: Any) -> None:
    left, right = fig.subplots(1, 2)
    kls = [(k, run.series(k)) for k in ("rollout_kl", "approx_kl", "ref_kl")]
    lines(left, kls, "KL [nats/token]", "no KL recorded")
    nll = sorted(run.sampled_nll.items())
    ents = [("trainer entropy", run.series("entropy")), ("sampled-token -logprob", ([s for s, _ in nll], [v for _, v in nll]))]
    lines(right, ents, "entropy [nats/token]", "no entropy recorded\n(train.loss.entropy_coef = 0, no rollouts/)")


@figure("logprob_diff", "Rollout vs trainer log-probabilities", "Mean and largest |trainer logprob - engine logprob| "
        "over the sampled tokens of each step (0 means the engine and the trainer agree exactly).",
        ("rollout_logprob_abs_diff", "rollout_logprob_abs_diff_max"))  # fmt: skip
def _logprob_diff(run: RunData, fig: Any) -> None:
    ax = fig.add_subplot()
    curves = [("mean |diff|", run.series("rollout_logprob_abs_diff")), ("max |diff|", run.series("rollout_logprob_abs_diff_max"))]
    if lines(ax, curves, "|logprob difference| [nats]", "no logprob difference recorded"):
        if all(v > 0 for _, (_, ys) in curves for v in ys):
            ax.set_yscale("log")


@figure("throughput", "Tokens per second", "Generation: response tokens over generation time. Trainer: tokens "
        "(prompt and response) through the trainer over the train stage time.",
        ("rollout/tokens_per_s", "tokens", "time/train_s"))  # fmt: skip
def _throughput(run: RunData, fig: Any) -> None:
    ax = fig.add_subplot()
    train = run.derived(lambda r: r["tokens"] / r["time/train_s"] if _finite(r.get("tokens")) and r.get("time/train_s") else None)
    lines(ax, [("generation", run.series("rollout/tokens_per_s")), ("trainer", train)], "tokens/s", "no throughput recorded")


@figure("memory", "Memory", "Peak resident memory so far of the run's processes (the job and its living children, "
        "each process's peak summed) and, on a GPU, torch's peak allocated memory in the job's process.",
        ("memory/peak_rss_gb", "memory/gpu_peak_allocated_gb"))  # fmt: skip
def _memory(run: RunData, fig: Any) -> None:
    ax = fig.add_subplot()
    curves = [("peak RSS (processes)", run.series("memory/peak_rss_gb")), ("GPU peak allocated", run.series("memory/gpu_peak_allocated_gb"))]
    lines(ax, curves, "GB", "no memory recorded (runs before memory/peak_rss_gb)")


def _rollout_part(r: dict[str, Any]) -> float:
    """The step's time spent on the rollout: the trainer's wait for its batch (generation and reward
    scoring; when generation overlaps training, only the wait adds to the step's time)."""
    return _get(r, "time/trainer_wait_s")


STAGES = (
    ("rollout: generation and reward (trainer wait)", _rollout_part),
    ("train", lambda r: _get(r, "time/train_s")),
    ("weight sync", lambda r: _get(r, "sync/seconds")),
    ("other", lambda r: _get(r, "seconds") - _rollout_part(r) - _get(r, "time/train_s") - _get(r, "sync/seconds")),
)


def algorithm_of(config: dict[str, Any]) -> str:
    """``train.algorithm`` of a resolved config (rl when absent)."""
    return (config.get("train") or {}).get("algorithm") or "rl"


def score_key(algorithm: str) -> str:
    """The ``eval.jsonl`` field a run's evaluations are judged by: a reward model's ``pair_accuracy``, else ``accuracy``."""
    return "pair_accuracy" if algorithm == "reward_model" else "accuracy"


def measured_evals(rows: list[dict[str, Any]], score: str = "accuracy") -> list[dict[str, Any]]:
    """Evaluations with a ``score`` (a reward model's: ``pair_accuracy``) that is valid, in order of the
    step they measured (fleet and checkpoint rows are written when they finish, out of step order)."""
    kept = [r for r in rows if _finite(r.get(score)) and r.get("valid") is not False]
    return sorted(kept, key=lambda r: int(r["step"]))


def blocking_eval_s(row: dict[str, Any]) -> float:
    """Seconds the loop waited for an evaluation (rows before eval.mode existed: all of it)."""
    return _get(row, "loop_wait_s" if "loop_wait_s" in row else "seconds")


def _get(row: dict[str, Any], key: str) -> float:
    value = row.get(key)
    return float(value) if _finite(value) else 0.0


@figure("stage_times", "Time per stage", "Wall time of each step split by stage (stacked): the trainer's wait for its "
        "batch (generation and reward scoring), trainer, weight sync, the rest, and the held-out evaluation run after "
        "the step (eval.jsonl; the step-0 evaluation is in the summary).",
        ("time/trainer_wait_s", "time/train_s", "sync/seconds", "seconds"))  # fmt: skip
def _stage_times(run: RunData, fig: Any) -> None:
    ax = fig.add_subplot()
    rows = [r for r in run.steps if _finite(r.get("seconds"))]
    if not rows:
        empty(ax, "no step times recorded")
        return
    steps = [int(r["step"]) for r in rows]
    eval_s = {int(e["step"]): blocking_eval_s(e) for e in run.evals}
    bottom = [0.0] * len(rows)
    stages = [*STAGES, ("evaluation (after the step)", lambda r: eval_s.get(int(r["step"]), 0.0))]
    for label, fn in stages:
        heights = [max(fn(r), 0.0) for r in rows]
        ax.bar(steps, heights, bottom=bottom, label=label, width=0.8)
        bottom = [b + h for b, h in zip(bottom, heights)]
    steps_axis(ax)
    ax.set_ylabel("seconds")
    ax.grid(alpha=0.3, axis="y")
    mark_resumes(ax)
    ax.legend(fontsize=8, ncols=3, loc="upper center", bbox_to_anchor=(0.5, -0.18))


@figure("buffer", "Buffer size and staleness", "Groups waiting in the buffer after each step's take (left) and the "
        "staleness of the groups trained: trainer version minus the oldest policy-token version (right). "
        "Synchronous RL (rollout.max_staleness 0) keeps both at 0.",
        ("buffer/size", "buffer/staleness_mean", "buffer/staleness_max"))  # fmt: skip
def _buffer(run: RunData, fig: Any) -> None:
    left, right = fig.subplots(1, 2)
    lines(left, [("groups waiting", run.series("buffer/size")), ("capacity", run.series("buffer/capacity"))], "groups", "no buffer size recorded")
    stale = [("mean", run.series("buffer/staleness_mean")), ("max", run.series("buffer/staleness_max"))]
    if lines(right, stale, "staleness [versions]", "no staleness recorded"):
        right.set_ylim(bottom=-0.5, top=max(1.5, max(v for _, (_, ys) in stale for v in ys) + 0.5))


@figure("weight_sync", "Weight sync", "Seconds to push the trainer's weights to the engines each step (left) "
        "and the bandwidth it reached (right).", ("sync/seconds", "sync/gb_per_s"))  # fmt: skip
def _weight_sync(run: RunData, fig: Any) -> None:
    left, right = fig.subplots(1, 2)
    lines(left, [("push", run.series("sync/seconds"))], "seconds", "no weight sync recorded")
    lines(right, [("bandwidth", run.series("sync/gb_per_s"))], "GB/s", "no weight sync recorded")


@figure("sft_loss", "SFT loss", "Mean next-token loss over the assistant tokens of each optimizer step.", ("loss",), SFT_FIGURES)
def _sft_loss(run: RunData, fig: Any) -> None:
    lines(fig.add_subplot(), [("loss", run.series("loss"))], "loss [nats/token]", "no loss recorded")


@figure("rm_loss", "Pairwise loss", "Mean -log sigmoid(r(chosen) - r(rejected)) over each step's preference pairs "
        "(left: the step's pairs; right: the held-out pairs at each evaluation). ln 2 = 0.693 is chance.", ("loss",), RM_FIGURES)  # fmt: skip
def _rm_loss(run: RunData, fig: Any) -> None:
    left, right = fig.subplots(1, 2)
    lines(left, [("train pairs", run.series("loss"))], "loss [nats/pair]", "no loss recorded")
    lines(right, [("held-out pairs", _eval_series(run, "loss"))], "loss [nats/pair]", "no evaluation recorded")


@figure("rm_pairs", "Pair accuracy and margin", "Share of pairs scored r(chosen) > r(rejected) (left: each step's "
        "pairs and the held-out pairs; 0.5 is chance) and the mean margin r(chosen) - r(rejected) (right).",
        ("pair_accuracy", "margin", "eval/pair_accuracy"), RM_FIGURES)  # fmt: skip
def _rm_pairs(run: RunData, fig: Any) -> None:
    left, right = fig.subplots(1, 2)
    lines(left, [("train pairs", run.series("pair_accuracy")), ("held-out pairs", _eval_series(run, "pair_accuracy"))],
          "pair accuracy", "no pair accuracy recorded")  # fmt: skip
    lines(right, [("train pairs", run.series("margin")), ("held-out pairs", _eval_series(run, "margin"))], "margin", "no margin recorded")


def _eval_series(run: RunData, key: str) -> tuple[list[int], list[float]]:
    rows = [e for e in run.evals if _finite(e.get(key))]
    return [int(e["step"]) for e in rows], [float(e[key]) for e in rows]


@figure("sft_grad_lr", "Gradient norm and learning rate", "Global gradient L2 norm before clipping (left) and the "
        "learning rate (right).", ("grad_norm", "lr"), SFT_FIGURES)  # fmt: skip
@figure("rm_grad_lr", "Gradient norm and learning rate", "Global gradient L2 norm before clipping (left) and the "
        "learning rate (right).", ("grad_norm", "lr"), RM_FIGURES)  # fmt: skip
def _sft_grad_lr(run: RunData, fig: Any) -> None:
    _grad_lr(run, fig)


@figure("sft_throughput", "Tokens per second", "Tokens (prompt and answer) through the trainer per second of each step.",
        ("tokens", "seconds"), SFT_FIGURES)  # fmt: skip
@figure("rm_throughput", "Tokens per second", "Tokens (prompt and both answers) through the trainer per second of each step.",
        ("tokens", "seconds"), RM_FIGURES)  # fmt: skip
def _sft_throughput(run: RunData, fig: Any) -> None:
    rate = run.derived(lambda r: r["tokens"] / r["seconds"] if _finite(r.get("tokens")) and r.get("seconds") else None)
    lines(fig.add_subplot(), [("trainer", rate)], "tokens/s", "no step times recorded")


def render_png(fig_spec: Figure, run: RunData) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure as MplFigure

    fig = MplFigure(figsize=(8.0, 3.6), dpi=100, layout="constrained")
    fig.suptitle(fig_spec.title, fontsize=11)
    _RESUMES[:] = run.resumed_at
    fig_spec.draw(run, fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


# ---------------------------------------------------------------------------------------- page


def write_report(folder: str | Path, out: str | Path | None = None) -> Path:
    """Render every plot of ``FIGURES`` to PNG and the HTML page; returns the page's path."""
    run = load_run(folder)
    out = Path(out) if out is not None else run.folder / "report"
    out.mkdir(parents=True, exist_ok=True)
    images = {}
    for spec in figures_of(run):
        png = render_png(spec, run)
        (out / f"{spec.slug}.png").write_bytes(png)
        images[spec.slug] = png
    grids = sample_grids(run, out)
    page = out / "report.html"
    page.write_text(render_html(run, images, grids))
    return page


def sample_grids(run: RunData, out: Path) -> list[tuple[str, bytes]]:
    """Image runs: the first and the last evaluation's grid of images (``RUN_DIR/eval/step-N.png``:
    ``noria.diffusion.evaluate``, or ``noria.eval.answer_grid`` for a vision-language policy), copied
    next to the page as ``samples_first.png`` / ``samples_last.png``; (caption, PNG) of each, none
    for a text run."""
    pngs = sorted((run.folder / "eval").glob("step-*.png"))
    picked = [("first", pngs[0]), ("last", pngs[-1])] if len(pngs) > 1 else [("first", p) for p in pngs]
    grids = []
    for which, path in picked:
        data = path.read_bytes()
        (out / f"samples_{which}.png").write_bytes(data)
        step = int(path.stem.split("-")[1])
        what = "a row per condition, unseen seeds" if run.config.get("diffusion") else "held-out prompts' images and the answers, green where they scored"
        grids.append((f"Evaluation images at step {step} ({what})", data))
    return grids


def render_html(run: RunData, images: dict[str, bytes], grids: list[tuple[str, bytes]] | None = None) -> str:
    name = run.config.get("name") or run.folder.name
    parts = [
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>Noria report: {html.escape(str(name))}</title><style>{CSS}</style></head><body>",
        f"<h1>Noria run report: {html.escape(str(name))}</h1>",
        f"<p class='meta'>Run folder <code>{html.escape(str(run.folder.resolve()))}</code>; "
        f"generated {time.strftime('%Y-%m-%d %H:%M:%S')} by <code>noria report</code>.</p>",
        summary_table(run),
        "<div class='plots'>",
    ]
    for spec in figures_of(run):
        data = base64.b64encode(images[spec.slug]).decode()
        parts.append(
            f"<figure id='{spec.slug}'><img class='plot' src='data:image/png;base64,{data}' "
            f"alt='{html.escape(spec.title)}' width='800' height='360'>"
            f"<figcaption><b>{html.escape(spec.title)}.</b> {html.escape(spec.caption)}</figcaption></figure>"
        )
    parts.append("</div>")
    for caption, png in grids or []:
        data = base64.b64encode(png).decode()
        parts.append(f"<figure><img src='data:image/png;base64,{data}' alt='{html.escape(caption)}'>"
                     f"<figcaption>{html.escape(caption)}</figcaption></figure>")  # fmt: skip
    parts.append(metric_table(figures_of(run)))
    parts.append(f"<h2>Resolved config</h2><pre class='config'>{html.escape(run.config_text or '(no config.yaml)')}</pre>")
    parts.append("</body></html>")
    return "\n".join(parts)


def summary_table(run: RunData) -> str:
    steps = run.steps
    total = (run.config.get("train") or {}).get("max_steps")
    rewards = run.series("rollout/reward_mean")[1]
    rows = [("steps", f"{len(steps)}" + (f" of {total}" if total else ""))]
    if steps:
        rows.append(("wall time of the steps", f"{sum(_get(r, 'seconds') for r in steps) / 60:.1f} min"))
    if rewards:
        k = min(3, len(rewards))
        rows.append(("rollout reward (first / last steps)", f"{sum(rewards[:k]) / k:.3f} -> {sum(rewards[-k:]) / k:.3f} (mean of {k})"))
    losses = run.series("loss")[1]
    if run.algorithm != "rl" and losses:
        k = min(3, len(losses))
        rows.append(("loss (first / last steps)", f"{sum(losses[:k]) / k:.4f} -> {sum(losses[-k:]) / k:.4f} (mean of {k})"))
    if run.resumed_at:
        rows.append(("resumed", ", ".join(f"after step {s}" for s in run.resumed_at)))
    for line in run.segments if len(run.segments) > 1 else []:  # one segment: the steps row says it all
        label, _, text = line.partition(": ")
        rows.append((label, text))
    if run.evals:  # each with its score (measured_evals)
        key = score_key(run.algorithm)
        first, last = run.evals[0], run.evals[-1]
        label = "held-out pair accuracy" if key == "pair_accuracy" else "held-out accuracy"
        rows.append((label, f"{first[key]:.1%} at step {first['step']} -> {last[key]:.1%} at step {last['step']}"))
    for key, label, fmt in (
        ("rollout/tokens_per_s", "generation tokens/s (mean)", "{:.0f}"),
        ("rollout_logprob_abs_diff_max", "largest |logprob diff|", "{:.3g}"),
        ("sync/seconds", "weight sync seconds (mean)", "{:.2f}"),
    ):
        ys = run.series(key)[1]
        if ys:
            value = max(ys) if key.endswith("_max") else sum(ys) / len(ys)
            rows.append((label, fmt.format(value)))
    body = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows)
    return f"<table class='summary'>{body}</table>"


def metric_table(figures: list[Figure]) -> str:
    keys = []
    for spec in figures:
        keys.extend(k for k in spec.keys if k not in keys)
    rows = []
    for key in keys:
        doc = metric_doc(key)
        unit, meaning = (doc.unit, doc.meaning) if doc else ("", "")
        rows.append(f"<tr><td><code>{html.escape(key)}</code></td><td>{html.escape(unit)}</td><td>{html.escape(meaning)}</td></tr>")
    head = "<tr><th>metric</th><th>unit</th><th>meaning</th></tr>"
    return f"<h2>Metrics plotted</h2><table class='metrics'>{head}{''.join(rows)}</table>"


CSS = """
body { font-family: system-ui, sans-serif; margin: 24px auto; max-width: 1720px; color: #222; }
h1 { font-size: 22px; } h2 { font-size: 17px; margin-top: 28px; }
.meta { color: #555; }
table { border-collapse: collapse; font-size: 13px; }
th, td { text-align: left; padding: 3px 10px; border-bottom: 1px solid #ddd; vertical-align: top; }
.plots { display: flex; flex-wrap: wrap; gap: 16px; }
figure { margin: 0; width: 820px; border: 1px solid #ddd; padding: 8px; box-sizing: border-box; }
figure img { width: 800px; height: 360px; display: block; }
figcaption { font-size: 12px; color: #444; margin-top: 6px; }
pre.config { background: #f6f6f6; padding: 12px; font-size: 12px; max-height: 600px; overflow: auto; }
"""
