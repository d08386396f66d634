"""``edgeprune derive``: NuWa class-specific derivation under a FLOPs / params budget.

    edgeprune derive --model fmnist-vit --classes 0,3,7 --flops 0.6 -o runs/nuwa-037

Labeled images of the target classes come from the train split (fmnist-vit) or ``--train-data``
(an ImageFolder, timm models); the final evaluation uses the test split / ``--eval-data``, with the
argmax taken over the target classes. See ``edgeprune.nuwa``.
"""

from __future__ import annotations

import click

from edgeprune.errors import UserError


def _load_labeled(spec, model_name: str, data, train_data, classes: list[int], per_class: int | None, seed: int):
    """Labeled target-class images (N, C, H, W) and labels from the training split."""
    import torch

    if model_name == "fmnist-vit":
        from edgeprune.data.fashion_mnist import load_split

        x, y = load_split("train", data)
        keep = torch.isin(y, torch.as_tensor(classes))
        x, y = x[keep], y[keep]
        if per_class is not None:
            idx = []
            g = torch.Generator().manual_seed(seed)
            for c in classes:
                ic = (y == c).nonzero().flatten()
                idx.append(ic[torch.randperm(len(ic), generator=g)[:per_class]])
            sel = torch.cat(idx).sort().values
            x, y = x[sel], y[sel]
        return x, y, "Fashion-MNIST train split"
    if spec.output_kind != "logits":
        raise UserError(f"{model_name} is not a classifier; NuWa derives classifiers")
    if train_data is None:
        raise UserError(f"{model_name}: pass --train-data DIR (an ImageFolder with one sub-folder per class)")
    from edgeprune.data.sources import FolderSource, list_image_folder, subset

    files, labels, _ = list_image_folder(train_data)
    chosen_f, chosen_l = [], []
    for c in classes:
        fc = [f for f, lbl in zip(files, labels) if lbl == c]
        fc, lc = subset(fc, [c] * len(fc), per_class if per_class is not None else 300, seed)
        chosen_f += fc
        chosen_l += lc
    if not chosen_f:
        return torch.empty(0, *spec.input_size), torch.empty(0, dtype=torch.long), str(train_data)
    src = FolderSource(chosen_f, chosen_l, spec.transform(), str(train_data))
    xs, ys = zip(*src.batches(64))
    return torch.cat(xs), torch.cat(ys), f"{train_data} (ImageFolder)"


def _load_eval(model_name: str, data, eval_data, spec, classes: list[int], n: int | None):
    import torch

    if model_name == "fmnist-vit":
        from edgeprune.data.fashion_mnist import load_split

        x, y = load_split("test", eval_data or data)
        keep = torch.isin(y, torch.as_tensor(classes))
        x, y = x[keep][:n], y[keep][:n]
        return x, y, f"Fashion-MNIST test split, {len(x)} images of the target classes"
    if eval_data is None:
        return None
    from edgeprune.data.sources import FolderSource, list_image_folder

    files, labels, _ = list_image_folder(eval_data)
    pairs = [(f, lbl) for f, lbl in zip(files, labels) if lbl in classes][:n]
    if not pairs:
        raise UserError(f"no evaluation images of the target classes in {eval_data}")
    src = FolderSource([p[0] for p in pairs], [p[1] for p in pairs], spec.transform(), str(eval_data))
    xs, ys = zip(*src.batches(64))
    return torch.cat(xs), torch.cat(ys), f"{eval_data}, {len(pairs)} images of the target classes"


@click.command("derive")
@click.option("--model", "model_name", default="fmnist-vit", show_default=True,
              help="fmnist-vit or a timm ViT/DeiT classifier name (with --checkpoint).")
@click.option("--checkpoint", type=click.Path(), default=None, help="Weights of a timm model.")
@click.option("--random-init", is_flag=True, help="timm model without weights (tests only).")
@click.option("--num-classes", type=int, default=None, help="Classifier outputs of a timm model.")
@click.option("--classes", required=True, help="Target classes: indices or names, comma-separated (e.g. 0,3,7 or 'T-shirt/top,Bag').")
@click.option("--flops", type=float, default=None, help="Fraction of the base model's FLOPs to keep, in (0, 1].")
@click.option("--params", type=float, default=None, help="Fraction of the base model's parameters to keep, in (0, 1].")
@click.option("--slice-head", is_flag=True, help="Slice the head to the target classes (default: suppress the others with a -100 bias).")
@click.option("--data", type=click.Path(), default=None, help="Fashion-MNIST directory (fmnist-vit).")
@click.option("--train-data", type=click.Path(), default=None, help="Labeled training images, ImageFolder (timm models).")
@click.option("--train-per-class", type=int, default=None, help="At most this many labeled images per class [fmnist-vit: all; folders: 300].")
@click.option("--calib", "calib_dir", type=click.Path(), default=None,
              help="Unlabeled calibration images (ImageFolder dir) [default: target-class training images].")
@click.option("--calib-size", type=int, default=128, show_default=True, help="Calibration images for OFP-MLP.")
@click.option("--val-size", type=int, default=300, show_default=True, help="Held-out target-class training images scoring SKP checkpoints and rho.")
@click.option("--skp-steps", type=int, default=400, show_default=True, help="SKP optimiser steps (0 = no SKP; the paper uses 10000).")
@click.option("--skp-batch-size", type=int, default=1, show_default=True)
@click.option("--skp-eval-every", type=int, default=50, show_default=True, help="Evaluate SKP masks every N steps.")
@click.option("--lr-beta", type=float, default=0.1, show_default=True)
@click.option("--lr-mask", type=float, default=1e-3, show_default=True)
@click.option("--weight-decay", type=float, default=0.05, show_default=True)
@click.option("--rho", type=float, default=None, help="Fix the retained singular-value energy ratio (default: search).")
@click.option("--key-bias", type=click.Choice(["drop", "augment"]), default="drop", show_default=True,
              help="Leave the softmax-invariant key bias out of the QK SVD, or augment with it.")
@click.option("--ridge-alpha", type=float, default=1e-4, show_default=True, help="Ridge of the fc2 least-squares re-fit.")
@click.option("--eval-data", type=click.Path(), default=None, help="Evaluation images (fmnist: its dir; timm: ImageFolder).")
@click.option("--eval-size", type=int, default=None, help="Evaluate on at most this many target-class images.")
@click.option("--no-eval", is_flag=True, help="Skip the final evaluation.")
@click.option("--no-cache", is_flag=True, help="Do not read or write the on-disk SVD cache.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--threads", type=int, default=None, help="torch CPU threads [torch's default].")
@click.option("-o", "--out", type=click.Path(), default=None, help="New run directory [runs/<model>-nuwa-<classes>-<budget>].")
@click.option("--quiet", is_flag=True, help="No progress bars.")
def derive_cmd(model_name, checkpoint, random_init, num_classes, classes, flops, params, slice_head, data,
               train_data, train_per_class, calib_dir, calib_size, val_size, skp_steps, skp_batch_size,
               skp_eval_every, lr_beta, lr_mask, weight_decay, rho, key_bias, ridge_alpha, eval_data, eval_size,
               no_eval, no_cache, seed, threads, out, quiet):
    """Derive a class-specific edge ViT with NuWa (SKP + SVD/least-squares pruning) under a budget."""
    from edgeprune.artifact import check_new_dir, save_run
    from edgeprune.nuwa.derive import (DeriveConfig, check_budget, derive, evaluate_targets, resolve_budget,
                                       resolve_classes)
    from edgeprune.nuwa.head import num_classes as head_classes
    from edgeprune.nuwa.skp import SKPConfig
    from edgeprune.zoo.registry import get_model_spec

    import torch

    metric, frac = resolve_budget(flops, params)
    if threads is not None:
        if threads < 1:
            raise UserError(f"--threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    if train_per_class is not None and train_per_class < 1:
        raise UserError(f"--train-per-class must be >= 1, got {train_per_class}")
    cfg = DeriveConfig(
        skp=SKPConfig(steps=skp_steps, batch_size=skp_batch_size, lr_beta=lr_beta, lr_mask=lr_mask,
                      weight_decay=weight_decay, eval_every=skp_eval_every, seed=seed),
        head="slice" if slice_head else "suppress", val_size=val_size, calib_size=calib_size, rho=rho,
        key_bias=key_bias, ridge_alpha=ridge_alpha, cache=not no_cache, seed=seed)
    cfg.validate()
    spec = get_model_spec(model_name, checkpoint, random_init, num_classes)
    if spec.output_kind != "logits":
        raise UserError(f"{model_name} is not a classifier; NuWa derives classifiers")
    base = spec.create(pretrained=True)
    if model_name == "fmnist-vit":
        from edgeprune.data.fashion_mnist import CLASSES as names
        names = list(names)
    elif train_data is not None:
        from edgeprune.data.sources import list_image_folder

        names = list_image_folder(train_data)[2] or None
    else:
        names = None
    cls = resolve_classes(classes, head_classes(base), names)
    tag = "-".join(str(c) for c in cls)
    out = out or f"runs/{model_name}-nuwa-{tag}-{metric}{frac:g}{'-slice' if slice_head else ''}"
    check_budget(base, cls, metric, frac, cfg, names)
    out_path = check_new_dir(out)

    x, y, train_desc = _load_labeled(spec, model_name, data, train_data, cls, train_per_class, seed)
    calibration = None
    if calib_dir is not None:
        calibration = spec.calibration_source(calib_size, seed=seed, data=calib_dir, eval_data=eval_data)
    click.echo(f"model {model_name}: classes {cls}"
               + (f" ({', '.join(names[c] for c in cls)})" if names else "")
               + f"; {metric} budget {frac:g}; labeled images: {train_desc}")
    res = derive(base, cls, x, y, flops=flops, params=params, calibration=calibration, config=cfg,
                 class_names=names, spec=spec, progress=not quiet)
    rec = res.record
    rec["derivation"]["data"]["train_source"] = train_desc
    d = rec["derivation"]
    rows = [("base", rec["dense_params"], rec["dense_flops"], None),
            ("anchor", d["anchor"]["params"], d["anchor"]["flops"], None),
            ("derived", rec["params"], rec["flops"], None)]
    if not no_eval:
        ev = _load_eval(model_name, data, eval_data, spec, cls, eval_size)
        if ev is not None:
            ex, ey, edesc = ev
            sliced = slice_head
            m_base = evaluate_targets(base, ex, ey, cls, False)[0]
            m_anchor = evaluate_targets(res.anchor_model, ex, ey, cls, sliced)[0]
            m_derived = evaluate_targets(res.model, ex, ey, cls, sliced)[0]
            rec["evaluation"] = {"data": edesc, "metric": "top-1 over the target classes (argmax over them)",
                                 "base": {"top1": m_base}, "anchor": {"top1": m_anchor},
                                 "derived": {"top1": m_derived}}
            rows = [(r[0], r[1], r[2], m) for r, m in zip(rows, (m_base, m_anchor, m_derived))]
            click.echo(f"evaluation: {edesc}")
    save_run(out_path, res.model, rec)
    click.echo("")
    click.echo(f"| {'':8} | {'params':>10} | {'MFLOPs':>9} | target top-1 |")
    click.echo(f"|{'-' * 10}|{'-' * 12}|{'-' * 11}|--------------|")
    for name, p, f, m in rows:
        q = "-" if m is None else f"{m * 100:.2f}%"
        click.echo(f"| {name:8} | {p:>10,} | {f / 1e6:>9.2f} | {q:>12} |")
    b = d["budget"]
    click.echo(f"\nnuwa: rho={d['rho']:g} qk={d['ofp_mha']['qk']} vo={d['ofp_mha']['vo']} mlp={d['ofp_mlp']['mlp']}; "
               f"anchor kept {d['anchor']['kept']} (SKP step {d['anchor']['step']}); "
               f"{metric} x{b['achieved_fraction']:.3f} (budget {frac:g}); head: {rec['head']['mode']}; "
               f"SVD factors: {d['ofp_mha']['svd_cache']['source']}")
    t = rec["timing"]
    click.echo(f"time: SKP {t['skp_s']:.1f} s, statistics {t['stats_s']:.1f} s, SVD {t['svd_s']:.1f} s, "
               f"budget search {t['search_s']:.1f} s; total {t['total_s']:.1f} s")
    click.echo(f"saved {out_path}")
