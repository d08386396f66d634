"""Options shared by several commands, defined once so that every command spells and explains
them the same way.

* :func:`model_options` -- ``--model``, ``--checkpoint``, ``--random-init``, ``--num-classes``,
  ``--img-size``, ``--model-kwargs`` (prune, eval, info, derive, export, verify);
* :func:`calibration_options` -- ``--calib``, ``--calib-size``, ``--seed``, ``--batch-size``;
* :func:`eval_options` -- ``--eval-data``, ``--eval-size``;
* :func:`device_option` -- ``--device PROFILE`` and ``--torch-device cpu|cuda|cuda:N|auto`` (checked before
  any work; :func:`edgeprune.jobs.models.torch_device_of` resolves them);
* :func:`labeled_data_options` -- derive's ``--classes`` and labeled images (``--data``, ``--train-data`` ...);
* :func:`quiet_option`, :func:`out_option`, :func:`threads_option`;
* :class:`FiniteFloat` (:data:`FINITE`) -- THE type of every float option of every command: ``nan``
  and ``inf`` are refused while parsing (issue 41), with optional bounds as ``click.FloatRange``.

:func:`make_spec` / :func:`load_model` turn the model options into a ``ModelSpec`` / a model.
"""

from __future__ import annotations

import json
import math
from typing import Any, Callable

import click

from edgeprune.errors import UserError
from edgeprune import network_ref

from edgeprune.cli.device_options import device_option  # noqa: F401 (handed on)

class FiniteFloat(click.FloatRange):
    """A float option that must be a finite number (``click.FloatRange`` bounds optional): ``nan``,
    ``inf`` and ``-inf`` -- which Python's ``float()`` parses and every comparison lets through --
    are one usage error line, exit 2, while the options are parsed (before any work)."""

    name = "float"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        rv = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return super().convert(rv, param, ctx)

    def _describe_range(self) -> str:
        return super()._describe_range() if (self.min is not None or self.max is not None) else "finite"


#: the unbounded finite float type (``type=FINITE``)
FINITE = FiniteFloat()

MODEL_HELP = "fmnist-vit, dinov2-s14, or a timm ViT/DeiT name (with --checkpoint or --random-init)."


def _apply(f: Callable, *decorators: Callable) -> Callable:
    for d in reversed(decorators):
        f = d(f)
    return f


def _remember(key: str) -> Callable:
    """An eager option's callback that keeps its value for :func:`_model_callback` (``ctx.meta``)."""
    def callback(ctx: click.Context, _param: click.Parameter, value: Any) -> None:
        if value is not None:
            ctx.meta[f"edgeprune.{key}"] = value
    return callback


def _model_callback(ctx: click.Context, _param: click.Parameter, value: Any) -> Any:
    """``--model``'s value, or the network reference of ``--model-file`` / ``--backbone``
    (:func:`edgeprune.zoo.network_file.network_ref`, checked while parsing)."""
    file, backbone = ctx.meta.get("edgeprune.model_file"), ctx.meta.get("edgeprune.backbone")
    if file is None:
        if backbone is not None:
            raise click.UsageError("--backbone goes with --model-file")
        return value
    if ctx.get_parameter_source("model_name") is click.core.ParameterSource.COMMANDLINE:
        raise click.UsageError("give --model or --model-file, not both")
    try:
        return network_ref(file, backbone)
    except UserError as err:
        raise click.UsageError(str(err)) from None


def model_options(default: str | None = None, help: str | None = None) -> Callable:
    """``--model NAME``, ``--checkpoint PATH``, ``--random-init``, ``--num-classes N``,
    ``--img-size N``, ``--model-kwargs K=V,...``; the command receives ``model_name, checkpoint,
    random_init, num_classes, img_size, model_kwargs``."""
    model_help = help or (MODEL_HELP if default else f"Use the dense model NAME instead of a run: {MODEL_HELP}")

    def deco(f: Callable) -> Callable:
        return _apply(
            f,
            click.option("--model", "model_name", metavar="NAME", default=default, show_default=default is not None,
                         help=model_help, callback=_model_callback),
            click.option("--model-file", metavar="FILE.py:FUNC", is_eager=True, expose_value=False,
                         callback=_remember("model_file"),
                         help="Your network instead of --model: FUNC() in FILE.py returns it (weights loaded) with "
                              "a timm ViT inside; --model-kwargs become FUNC's keywords."),
            click.option("--backbone", metavar="PATH", is_eager=True, expose_value=False,
                         callback=_remember("backbone"),
                         help="With --model-file: the attribute path of the ViT to prune (e.g. encoder or "
                              "pretrained.vit) [the only ViT inside]."),
            click.option("--checkpoint", type=click.Path(), default=None, metavar="PATH",
                         help="Weights of a timm model (safetensors or timm .pth, loaded without pickle)."),
            click.option("--random-init", is_flag=True,
                         help="A timm model with seeded random weights (tests, latency only)."),
            click.option("--num-classes", type=click.IntRange(min=1), default=None, metavar="N",
                         help="Classifier outputs of a timm model [the model's own]."),
            click.option("--img-size", type=click.IntRange(min=1), default=None, metavar="N",
                         help="Input image size of a timm model, where the model supports it: at least, and a "
                              "multiple of, its patch size [the model's own]."),
            click.option("--model-kwargs", default=None, metavar="K=V,...", callback=_kwargs_callback,
                         help="Further timm.create_model keywords of a timm model (values as JSON, else plain "
                              "strings; a value starting with { [ or \" must be valid JSON), "
                              "e.g. depth=6,drop_path_rate=0."),
        )
    return deco


def _split_items(text: str) -> list[str]:
    """Split ``K=V,K=V`` on the commas outside JSON brackets and strings."""
    items, depth, quoted, escaped, start = [], 0, False, False, 0
    for i, ch in enumerate(text):
        if quoted:
            escaped = not escaped and ch == "\\"
            if ch == '"' and not escaped:
                quoted = False
            continue
        if ch == '"':
            quoted = True
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth = max(0, depth - 1)
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return items


def parse_model_kwargs(text: str | None) -> dict[str, Any] | None:
    """``"depth=6,global_pool=avg,x={"a":1,"b":2}"`` -> ``{"depth": 6, "global_pool": "avg",
    "x": {"a": 1, "b": 2}}``: values are JSON, else plain strings; commas inside JSON brackets or
    strings do not split. None for None or an empty string.

    Raises:
        UserError: an item without ``=``, an empty key, or a value that starts like JSON (``{``,
            ``[`` or ``"``) but is not valid JSON ("invalid JSON for KEY").
    """
    if not text:
        return None
    out: dict[str, Any] = {}
    for item in _split_items(text):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"--model-kwargs wants key=value pairs separated by commas, got {item!r}")
        key, value = key.strip(), value.strip()
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError as err:
            if value[:1] in ("{", "[", '"'):
                raise UserError(f"--model-kwargs: invalid JSON for {key}: {value!r} ({err.msg} at "
                                f"character {err.pos})") from None
            out[key] = value
    return out


def _kwargs_callback(ctx: click.Context, param: click.Parameter, value: Any) -> dict[str, Any] | None:
    if isinstance(value, dict):  # a recipe file's inline table (--config)
        return dict(value) or None
    return parse_model_kwargs(value)


def calibration_options(size_help: str, batch_default: int = 32) -> Callable:
    """``--calib DIR``, ``--calib-size N``, ``--seed N``, ``--batch-size N``."""
    def deco(f: Callable) -> Callable:
        return _apply(
            f,
            click.option("--calib", "calib_dir", type=click.Path(), default=None, metavar="DIR",
                         help="Calibration data: the Fashion-MNIST dir (fmnist-vit) or an ImageFolder dir "
                              "(timm models); dinov2-s14 uses its bundled photos."),
            click.option("--calib-size", type=int, default=None, metavar="N", help=size_help),
            click.option("--seed", type=int, default=0, show_default=True,
                         help="Seed of the calibration sampling (and of training, where there is one)."),
            click.option("--batch-size", type=int, default=batch_default, show_default=True,
                         help="Images per batch."),
        )
    return deco


def eval_options(f: Callable) -> Callable:
    """``--eval-data DIR``, ``--eval-size N``."""
    return _apply(
        f,
        click.option("--eval-data", type=click.Path(), default=None, metavar="DIR",
                     help="Evaluation data: the Fashion-MNIST dir (fmnist-vit) or an ImageFolder dir with "
                          "class sub-folders (timm models); never overlapping the calibration images."),
        click.option("--eval-size", type=click.IntRange(min=1), default=None, metavar="N",
                     help="Evaluate on at most N images."),
    )


def quiet_option(f: Callable) -> Callable:
    """``--quiet``: no progress display (bars on a terminal, a few log lines otherwise)."""
    return click.option("--quiet", is_flag=True, help="No progress bars or progress lines.")(f)


def latency_table_option(f: Callable) -> Callable:
    """``--latency-table FILE``: the table a ``--latency`` budget is priced on (derive, deploy; prune declares it in
    ``edgeprune.budget.settings``)."""
    return click.option("--latency-table", "latency_table", default=None, metavar="FILE",
                        help="The latency table of --latency (made by `edgeprune latency-table --model M "
                             "--device PROFILE`).")(f)


def no_eval_option(help_text: str) -> Callable:
    """``--no-eval``: skip the evaluation (``help_text`` says which)."""
    return click.option("--no-eval", is_flag=True, help=help_text)


def out_option(default_help: str) -> Callable:
    """``-o/--out DIR``: a new run directory (never overwritten)."""
    return click.option("-o", "--out", type=click.Path(), default=None, metavar="DIR",
                        help=f"New run directory (must not exist) [{default_help}].")


def labeled_data_options(f: Callable) -> Callable:
    """derive's target classes and images: ``--classes``, ``--data``, ``--train-data``, ``--train-per-class``,
    ``--calib``, ``--calib-size``, ``--val-size``, the evaluation (:func:`eval_options`, ``--no-eval``) and ``--seed``
    (the job's inputs, not settings: ``edgeprune.nuwa.settings``)."""
    return _apply(
        f,
        click.option("--classes", required=True,
                     help="Target classes: indices or names, comma-separated (e.g. 0,3,7 or 'T-shirt/top,Bag')."),
        click.option("--data", type=click.Path(), default=None, metavar="DIR",
                     help="Fashion-MNIST directory (fmnist-vit)."),
        click.option("--train-data", type=click.Path(), default=None, metavar="DIR",
                     help="Labeled training images, ImageFolder (timm models)."),
        click.option("--train-per-class", type=int, default=None,
                     help="At most this many labeled images per class [fmnist-vit: all; folders: 300]."),
        click.option("--calib", "calib_dir", type=click.Path(), default=None, metavar="DIR",
                     help="Unlabeled calibration images (ImageFolder dir) [target-class training images]."),
        click.option("--calib-size", type=int, default=128, show_default=True, help="Calibration images for OFP-MLP."),
        click.option("--val-size", type=int, default=300, show_default=True,
                     help="Held-out target-class training images scoring SKP checkpoints and rho."),
        eval_options,
        no_eval_option("Skip the final evaluation."),
        click.option("--seed", type=int, default=0, show_default=True, help="Data split, sampling and SKP seed."),
    )


def threads_option(help_text: str) -> Callable:
    """``--threads N`` (at least 1): torch's CPU threads (``help_text`` says the default)."""
    return click.option("--threads", type=click.IntRange(min=1), default=None, help=help_text)


def profile_options(torch_help: str) -> Callable:
    """``--device PROFILE`` (required: the deployment profile the job is for; checked by the job, one line) and
    ``--torch-device DEVICE`` (``torch_help``: where its torch passes run and the default); the command receives
    ``device`` and ``torch_device`` (deploy)."""
    return lambda f: _apply(
        f,
        click.option("--device", required=True, metavar="PROFILE",
                     help="Deployment profile: cpu, rtx3090, orin-nx or a .toml file (`edgeprune devices`)."),
        click.option("--torch-device", "torch_device", default=None, metavar="DEVICE", help=torch_help),
    )


def folder_option(help_text: str) -> Callable:
    """``-o/--out DIR`` (required): the job's folder (``help_text`` says what it may be; deploy: new or its own)."""
    return click.option("-o", "--out", required=True, type=click.Path(), metavar="DIR", help=help_text)


def json_option(help_text: str) -> Callable:
    """``--json FILE``: also write the job's report (``help_text`` says which) as JSON; the command receives
    ``json_out``."""
    return click.option("--json", "json_out", type=click.Path(), default=None, metavar="FILE", help=help_text)


class IntList(click.ParamType):
    """A comma-separated list of integers (``1,8``) -> a tuple, each at least ``min``: a word that is not an integer
    or nothing at all is one usage error line, exit 2 ("expected comma-separated integers"), as is a value below
    ``min`` ("batch sizes must be positive integers", named by the parameter)."""

    name = "integers"

    def __init__(self, min: int | None = None) -> None:
        self.min = min

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        items = list(value) if isinstance(value, (list, tuple)) else [v for v in str(value).split(",") if v.strip()]
        try:
            out = tuple(int(v) for v in items)
        except (TypeError, ValueError):
            self.fail(f"expected comma-separated integers, got {value!r}", param, ctx)
        if not out:
            self.fail(f"expected comma-separated integers, got {value!r}", param, ctx)
        if self.min is not None and min(out) < self.min:
            what = (param.name or "values").replace("_", " ") if param is not None else "values"
            rule = {1: "positive integers", 0: "non-negative integers"}.get(self.min, f"integers >= {self.min}")
            self.fail(f"{what} must be {rule}, got {value!r}", param, ctx)
        return out


def recorded_calibration_options(f: Callable) -> Callable:
    """``--calib DIR``, ``--calib-size N`` (at least 1), ``--seed N`` of a job that calibrates a run or an export
    (quantize): each not given = what the run recorded; the command receives ``calib_dir, calib_size, seed``."""
    return _apply(
        f,
        click.option("--calib", "calib_dir", type=click.Path(), default=None, metavar="DIR",
                     help="Calibration data: the Fashion-MNIST dir (fmnist-vit) or an ImageFolder dir (timm models) "
                          "[the model's own, as for prune]."),
        click.option("--calib-size", type=click.IntRange(min=1), default=None, metavar="N",
                     help="Calibration images (without a recorded size: fmnist-vit 512, dinov2-s14 64, timm 256) "
                          "[the run's own]."),
        click.option("--seed", type=int, default=None,
                     help="Seed of the calibration sampling [the run's recorded seed, else 0]."),
    )


def file_out_option(long: str, metavar: str, help_text: str, path_type: type | None = None,
                    required: bool = True) -> Callable:
    """``-o/--<long> FILE``: the file the job writes (quantize's and export's ``--output``, latency-table's ``--out``;
    ``required``: else the job's default, which ``help_text`` says: build's engine); the command receives it named
    ``long`` (a ``path_type``: ``Path``; None: the text)."""
    # no default=None when required: click 8.3 counts an explicit None as given
    return click.option("-o", f"--{long}", required=required, type=click.Path(path_type=path_type), metavar=metavar,
                        help=help_text)


def force_option(help_text: str) -> Callable:
    """``--force``: replace what the job would otherwise refuse to overwrite (``help_text`` says what)."""
    return click.option("--force", is_flag=True, help=help_text)


def profile_option(help_text: str, *, default: str | None = None, required: bool = False) -> Callable:
    """``--device PROFILE`` [``default``]: the device profile a job times, builds or benches for (latency-table,
    build, bench; ``help_text`` says what it chooses; a bad name is the job's one-line error); the command receives
    ``device``."""
    if required:  # no default=None when required: click 8.3 counts an explicit None as given
        return click.option("--device", "device", required=True, metavar="PROFILE", help=help_text)
    return click.option("--device", "device", default=default, show_default=default is not None, metavar="PROFILE",
                        help=help_text)
