"""``gram_tokens`` / ``--gram-tokens K``: MLP statistics from K evenly spaced tokens per image
(a random subset per image: edgeprune.calibration.mlp_stats.token_positions; docs/prune_cost.md). An estimator of the
all-token statistics: exact where it promises (K >= n is the all-token run bit for bit; the
statistics are exactly those of the selected tokens), and still a compensation that helps."""

from __future__ import annotations

import pytest
import torch

from edgeprune.calibration.mlp_stats import MLPStatistics, token_positions
from tests.conftest import assert_one_line_error, needs_fmnist, run_cli


@pytest.mark.parametrize("n,k", [(197, 64), (257, 64), (49, 12), (49, 48), (10, 1)])
def test_positions_are_a_sorted_subset_fixed_by_the_image_index(n, k):
    a, b = token_positions(n, k, 7), token_positions(n, k, 7)
    assert a is not None and a.dtype == torch.int64 and len(a) == k
    assert torch.equal(a, b)  # deterministic
    assert bool((a.diff() > 0).all()) and int(a[0]) >= 0 and int(a[-1]) < n
    others = [token_positions(n, k, j) for j in range(8, 16)]
    assert any(not torch.equal(a, o) for o in others)  # each image its own subset


def test_every_position_is_equally_likely():
    """Unbiased: over 4000 images each of 49 positions is drawn ~4000 * 12 / 49 times (within
    10%, ~5 standard deviations). A fixed subset (the same positions for every image) fails."""
    counts = torch.zeros(49)
    for j in range(4000):
        counts[token_positions(49, 12, j)] += 1
    expected = 4000 * 12 / 49
    assert float((counts - expected).abs().max()) < 0.1 * expected, counts


def test_positions_none_means_every_token():
    assert token_positions(197, 0, 0) is None and token_positions(197, 197, 3) is None
    assert token_positions(197, 500, 0) is None
    with pytest.raises(ValueError):
        token_positions(0, 4, 0)
    with pytest.raises(ValueError):
        token_positions(10, 4, -1)


def test_statistics_are_those_of_the_selected_tokens():
    """tokens=k on (B, n, D) batches == all-token statistics of each image's own positions
    (bitwise: same products), with the image index continuing across batches from first_image."""
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(3, 37, 12, generator=g) * (1 + i) + i for i in range(3)]
    sub, full, ref = MLPStatistics(12, tokens=9, first_image=5), MLPStatistics(12), MLPStatistics(12)
    j = 5
    for h in batches:
        sub.add_batch(h)
        full.add_batch(h)
        rows = []
        for img in h:
            rows.append(img[token_positions(37, 9, j)])
            j += 1
        ref.add_batch(torch.stack(rows))
    assert sub.count == 3 * 3 * 9 and full.count == 3 * 3 * 37 and sub.images_seen == 9
    for attr in ("mean", "cov", "energy", "active_prob"):
        assert torch.equal(getattr(sub, attr), getattr(ref, attr)), attr
    assert not torch.allclose(sub.cov, full.cov)  # the subset really is a subset


@pytest.fixture(scope="module")
def fm_runs(fmnist_calib):
    """fmnist-vit MLP-only CORP at 0.5 on 256 images with all tokens, K = n (49), K = 12, a fixed
    K = 12 subset for every image (the biased alternative), and no compensation; plus held-out
    images."""
    import edgeprune

    calib, held, _ = fmnist_calib
    spec = edgeprune.get_model_spec("fmnist-vit")
    out = {}
    runs = {"all": {}, "k=n": {"gram_tokens": 49}, "k=12": {"gram_tokens": 12}, "fixed": {"gram_tokens": 12},
            "none": {"compensation": False}}
    fixed = token_positions(49, 12, 0)
    for name, kw in runs.items():
        with pytest.MonkeyPatch.context() as mp:
            if name == "fixed":
                mp.setattr("edgeprune.calibration.mlp_stats.token_positions", lambda n, k, j: fixed)
            out[name] = edgeprune.prune(spec.create(pretrained=True), calib, spec=spec, target="mlp",
                                        sparsity=0.5, progress=False, **kw)
    return out, spec.create(pretrained=True).eval(), held[:128]


@needs_fmnist
def test_k_at_least_n_is_the_all_token_run(fm_runs):
    runs, _, _ = fm_runs
    a, b = runs["all"].model.state_dict(), runs["k=n"].model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert runs["k=n"].record["settings"]["gram_tokens"] == 49


@needs_fmnist
def test_fewer_tokens_still_compensate(fm_runs):
    """K = 12 of 49 tokens: different folded weights, same kind of result: the output error on
    held-out images is far below no compensation and within 1.5x of the all-token run's; the
    same 12 positions for every image (biased) are clearly worse."""
    runs, dense, held = fm_runs
    a, b = runs["all"].model.state_dict(), runs["k=12"].model.state_dict()
    assert any(not torch.equal(a[k], b[k]) for k in a if "fc2" in k)
    with torch.no_grad():
        ref = dense(held)
        err = {k: float((runs[k].model(held) - ref).pow(2).mean()) for k in ("all", "k=12", "fixed", "none")}
    print(err)
    assert err["k=12"] < 0.5 * err["none"]
    assert err["k=12"] < 1.5 * err["all"]
    assert err["fixed"] > 1.5 * err["k=12"]


def test_bad_gram_tokens_are_one_line_errors(tmp_path):
    r = run_cli(["prune", "--random-init", "--gram-tokens", "-3", "--no-eval", "--quiet", "-o", tmp_path / "a"])
    assert_one_line_error(r, "gram tokens must be an int >= 0")
    r = run_cli(["prune", "--random-init", "--gram-tokens", "8", "--sequential", "--no-eval", "--quiet",
                 "-o", tmp_path / "b"])
    assert_one_line_error(r, "--sequential")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.parametrize("n_img,hidden,tokens,expected", [
    (256, 1536, 197, 0),      # deit_small / DINOv2-S at 256 images: 192 > half the tokens -> all
    (256, 1536, 257, 0),
    (512, 1536, 197, 96),     # 32 samples per hidden channel
    (512, 1536, 257, 96),
    (1024, 1536, 257, 64),    # floor of 64 tokens per image
    (1024, 3072, 197, 96),    # deit_base at 1024 images
    (4096, 3072, 197, 64),
    (512, 512, 49, 0),        # fmnist-vit (49 tokens): always all tokens
    (None, 1536, 197, 0),     # unknown calibration size: all tokens
])
def test_auto_tokens_rule(n_img, hidden, tokens, expected):
    from edgeprune.calibration.mlp_stats import auto_gram_tokens

    k = auto_gram_tokens(n_img, hidden, tokens)
    assert k == expected
    if k:
        assert k >= 64 and k * n_img >= 32 * hidden and k <= 0.5 * tokens


def test_default_is_auto_and_resolves_per_model_and_setting():
    """gram_tokens=None: the auto rule for one-shot CORP, all tokens with --sequential; explicit
    values are used as given; a random-init deit_tiny (197 tokens, MLP 768; 2 of its 12 blocks: the rule
    reads the tokens and the MLP width, not the depth) pruned with 256 images by default uses 96 tokens
    and is the same model, bit for bit, as an explicit --gram-tokens 96, and the record says so; with 64
    images it uses all tokens."""
    import timm

    import edgeprune
    from edgeprune.anatomy import find_anatomy
    from edgeprune.corp import CorpConfig, gram_tokens_used

    torch.manual_seed(0)
    model = timm.create_model("deit_tiny_patch16_224", pretrained=False, depth=2).eval()
    an = find_anatomy(model)
    assert CorpConfig().gram_tokens is None
    assert gram_tokens_used(CorpConfig.from_target("both", 0.5), an, 256) == 96
    assert gram_tokens_used(CorpConfig.from_target("both", 0.5), an, 64) == 0
    assert gram_tokens_used(CorpConfig.from_target("both", 0.5, sequential=True), an, 256) == 0
    assert gram_tokens_used(CorpConfig.from_target("both", 0.5, gram_tokens=0), an, 256) == 0
    assert gram_tokens_used(CorpConfig.from_target("both", 0.5, gram_tokens=40), an, 64) == 40
    x = torch.randn(256, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    auto = edgeprune.prune(model, x, target="mlp", sparsity=0.5, progress=False)
    explicit = edgeprune.prune(model, x, target="mlp", sparsity=0.5, progress=False, gram_tokens=96)
    exact = edgeprune.prune(model, x, target="mlp", sparsity=0.5, progress=False, gram_tokens=0)
    assert auto.record["settings"]["gram_tokens"] == "auto" and auto.record["settings"]["gram_tokens_used"] == 96
    assert exact.record["settings"]["gram_tokens_used"] == 0
    a, b, c = (r.model.state_dict() for r in (auto, explicit, exact))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a if "fc2" in k)
