"""sensitivity_analysis_pass: per-layer quantization and per-group pruning sensitivity on real small models."""

from __future__ import annotations

import functools
import json
import math
from typing import Any

import pytest
import torch
from conftest import TinyMLP, make_gpt, make_tiny_bert

from fxforge import ForgeGraph, passes
from fxforge.passes import PassArgsError
from fxforge.passes.analysis.sensitivity import quantized_weight, weight_spec
from fxforge.passes.analysis.sensitivity_types import SensitivityInfo

METHODS = ("fisher", "hessian_trace", "sqnr", "loss")
FAST = {"widths": [2, 8], "probes": 1}


def _bert_batches(n: int = 1, batch: int = 4, seq: int = 8) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    out = []
    for _ in range(n):
        ids = torch.randint(1, 100, (batch, seq), generator=gen)
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                    "labels": torch.randint(0, 2, (batch,), generator=gen)})
    return out


@pytest.fixture(scope="module")
def bert() -> ForgeGraph:
    return ForgeGraph(make_tiny_bert(), hf_input_names=["input_ids", "attention_mask", "labels"]).eval()


@pytest.fixture(scope="module")
def mlp() -> ForgeGraph:
    torch.manual_seed(0)
    return ForgeGraph(TinyMLP().eval(), (torch.randn(4, 8),))


def _mlp_batches(labels: bool = True) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 6, 8, generator=gen)
    return [{"x": x[i], **({"labels": torch.randint(0, 3, (6,), generator=gen)} if labels else {})} for i in range(2)]


def _state(mg: ForgeGraph) -> list[Any]:
    return [(n, t.clone(), t.data_ptr(), t._version, t.requires_grad, None if t.grad is None else t.grad.clone())
            for n, t in (*mg.model.named_parameters(), *mg.model.named_buffers())]


@pytest.fixture(scope="module")
def bert_runs(bert: ForgeGraph) -> tuple[ForgeGraph, list[Any], str, dict[str, SensitivityInfo]]:
    """Each method run once on a training-mode copy holding a user's gradient and a frozen embedding."""
    mg = bert.copy().train()
    mg.model.classifier.weight.grad = torch.full_like(mg.model.classifier.weight, 0.5)
    mg.model.bert.embeddings.word_embeddings.weight.requires_grad_(False)
    before, code = _state(mg), mg.model.code
    infos = {}
    for method in METHODS:
        out, infos[method] = passes.sensitivity_analysis_pass(mg, {"data": _bert_batches(), "method": method, **FAST})
        assert out is mg
    return mg, before, code, infos


def test_graph_unchanged(bert_runs: tuple[ForgeGraph, list[Any], str, dict[str, SensitivityInfo]]) -> None:
    """Weights (values, storage, version), flags, gradients, mode and code are as they were after every method."""
    mg, before, code, infos = bert_runs
    assert mg.model.training and mg.model.code == code
    for (n, t, ptr, ver, rg, g), (n2, t2, ptr2, ver2, rg2, g2) in zip(before, _state(mg), strict=True):
        assert (n, ptr, ver, rg) == (n2, ptr2, ver2, rg2)
        assert torch.equal(t, t2), n
        assert (g is None and g2 is None) or torch.equal(g, g2), n
    assert [r.name for r in mg.history[-len(METHODS):]] == ["sensitivity_analysis_pass"] * len(METHODS)
    assert [i.method for i in infos.values()] == list(METHODS)


def test_perturbation_is_the_quantize_pass(mlp: ForgeGraph) -> None:
    """The weight measured is bit for bit the quantize pass's, and sqnr's noise is that of the quantized graph."""
    batches = _mlp_batches()
    for fmt, params in (("integer", {"frac_width": "auto"}), ("scaled_integer", {"granularity": "per_channel"})):
        config = {"name": fmt, "weight_width": 3, **{f"weight_{k}": v for k, v in params.items()}}
        q, _ = passes.quantize_transform_pass(mlp, {"by": "name", "fc1": {"config": config}})
        layer = q.model.get_submodule("fc1")
        expected = layer.weight_quantizer(layer.weight)
        assert torch.equal(quantized_weight(mlp.model.fc1.weight, weight_spec(fmt, 3, params)), expected)
        _, info = passes.sensitivity_analysis_pass(mlp, {"data": batches, "method": "sqnr", "widths": [3],
                                                         "format": fmt, "format_params": params})
        with torch.no_grad():
            ref = [mlp(b["x"]) for b in batches]
            noise = sum(float(((q(b["x"]) - r) ** 2).sum()) for b, r in zip(batches, ref))
        signal = sum(float((r**2).sum()) for r in ref)
        assert info.layers[0].name == "fc1"
        assert info.layers[0].delta(3) == pytest.approx(noise / signal, rel=1e-5)


@pytest.mark.parametrize("method", METHODS)
def test_methods_on_bert_gpt_mlp(bert_runs: Any, mlp: ForgeGraph, method: str) -> None:
    """Every Linear measured at every width, coarser widths hurt more; heads and FFNs only where they exist."""
    gpt = ForgeGraph(make_gpt(), (torch.randint(0, 64, (2, 16)),))
    gen = torch.Generator().manual_seed(5)
    gpt_batches = [{"idx": torch.randint(0, 64, (2, 16), generator=gen),
                    "labels": torch.randint(0, 64, (2, 16), generator=gen)}]
    bert, infos = bert_runs[0], bert_runs[3]
    cases = [(bert, None, 14, {"heads": 2, "ffn": 2}), (gpt, gpt_batches, 9, {"heads": 2, "ffn": 2}),
             (mlp, _mlp_batches(), 2, {})]
    for mg, batches, n_linear, kinds in cases:
        info = infos[method] if batches is None else \
            passes.sensitivity_analysis_pass(mg, {"data": batches, "method": method, **FAST})[1]
        names = [name for _, name, _, _ in passes.select.select_nodes(mg.model, {"type": ["linear"]})]
        assert [s.name for s in info.layers] == names and len(names) == n_linear
        for s in info.layers:
            assert [w for w, _ in s.quant] == [8, 2] and all(math.isfinite(d) for _, d in s.quant)
            assert abs(s.delta(2)) >= abs(s.delta(8)), (s.name, s.quant)  # measured ("loss"): both may round to 0
        assert sum(abs(s.delta(2)) > abs(s.delta(8)) for s in info.layers) >= n_linear // 2, info.layers
        assert sorted(info.ranking(2)) == sorted(names)
        assert {k: sum(g.kind == k for g in info.groups) for k in kinds} == kinds
        assert len(info.groups) == sum(kinds.values())
        for g in info.groups:
            assert len(g.unit_scores) == g.units and [r for r, _ in g.prune] == [0.25, 0.5, 0.75]


def test_heads_match_prune_pass(bert: ForgeGraph, bert_runs: Any) -> None:
    """Head groups use the pruning pass's names and taylor ranking: at ratio 0.5 the heads counted removed are
    the ones prune_transform_pass masks, and the loss increase is that of its masked graph."""
    batches, info = _bert_batches(), bert_runs[3]["fisher"]
    pruned, _ = passes.prune_transform_pass(bert, {"weight": {"sparsity": 0.5, "method": "taylor",
                                                              "granularity": "head"}, "data": batches})
    heads = [g for g in info.groups if g.kind == "heads"]
    assert [g.name for g in heads] == ["bert_encoder_layer_0_attention_self_sdpa",
                                       "bert_encoder_layer_1_attention_self_sdpa"]
    for i, g in enumerate(heads):
        mask = pruned.model.get_submodule(f"bert.encoder.layer.{i}.attention.self.query").weight_mask
        masked = {h for h in range(4) if not bool(mask[h * 8:(h + 1) * 8].any())}
        assert masked == set(torch.argsort(torch.tensor(g.unit_scores))[:2].tolist())
        assert f"bert.encoder.layer.{i}.attention.self.value" in g.layers
    ffn = [g.name for g in info.groups if g.kind == "ffn"]
    assert ffn == ["bert.encoder.layer.0.intermediate.dense", "bert.encoder.layer.1.intermediate.dense"]
    # both heads groups masked at once by the prune pass; each group alone by the analysis: compare one group
    single, _ = passes.prune_transform_pass(bert, {"weight": {"sparsity": 0.5, "method": "taylor",
                                                              "granularity": "head"}, "data": batches,
                                                   "targets": {"name": [f"bert.encoder.layer.0.attention.self.{p}"
                                                                        for p in ("query", "key", "value")]}})
    with torch.no_grad():
        single_loss = sum(float(single(**b).loss) for b in batches) / len(batches)
    assert dict(heads[0].prune)[0.5] == pytest.approx(single_loss - info.baseline_loss, abs=1e-6)
    assert dict(heads[0].prune)[0.5] != 0.0


def test_sqnr_needs_no_labels(mlp: ForgeGraph) -> None:
    _, info = passes.sensitivity_analysis_pass(mlp, {"data": _mlp_batches(labels=False), "method": "sqnr", **FAST})
    assert info.baseline_loss == 0.0 and info.layers[0].delta(2) > 0


@pytest.mark.parametrize("args, words", [
    ({}, "no data"),
    ({"data": "BATCHES", "method": "fisher", "loss_fn": None, "nolabels": True}, "labels"),
    ({"data": "BATCHES", "method": "gradient"}, "'method'"),
    ({"data": "BATCHES", "widths": [1, 4]}, "width 1 is not supported by format 'integer'"),
    ({"data": "BATCHES", "widths": [5], "format": "mxfp", "format_params": {"exponent_width": 2}}, "width 5"),
    ({"data": "BATCHES", "prune_ratios": [0.5, 1.0]}, "prune_ratios"),
    ({"data": "BATCHES", "targets": ["softmax"]}, "targets"),
    ({"data": "BATCHES", "bits": 4}, "unknown pass_args key"),
])
def test_bad_args_refused(mlp: ForgeGraph, args: dict[str, Any], words: str) -> None:
    args = dict(args)
    nolabels = args.pop("nolabels", False)
    if args.get("data") == "BATCHES":
        args["data"] = _mlp_batches(labels=not nolabels)
    with pytest.raises(PassArgsError, match="sensitivity_analysis_pass") as err:
        passes.sensitivity_analysis_pass(mlp, args)
    assert words in str(err.value)


def test_config_copied_data_by_reference(mlp: ForgeGraph) -> None:
    """The caller's dict is not changed; a one-shot iterable of batches is read once, by reference."""
    params = {"frac_width": "auto"}
    args = {"data": iter(_mlp_batches()), "method": "fisher", "format_params": params, "widths": [3]}
    _, info = passes.sensitivity_analysis_pass(mlp, args)
    assert params == {"frac_width": "auto"} and len(info.layers) == 2
    assert next(args["data"], None) is None  # consumed: the pass read the caller's iterator, not a copy


def test_json_round_trip_and_hostile_values(bert_runs: Any) -> None:
    info = bert_runs[3]["fisher"]
    text = json.dumps(info.to_json())
    back = SensitivityInfo.from_json(json.loads(text))
    assert back == info and back.groups[0].layers == info.groups[0].layers
    edits = [
        lambda d: d["layers"][0]["quant"][0].__setitem__(1, float("nan")),
        lambda d: d["layers"][0].__setitem__("params", "1024"),
        lambda d: d["groups"][0]["unit_scores"].__setitem__(0, float("inf")),
        lambda d: d["groups"][0].__setitem__("kind", "rows"),
        lambda d: d["groups"][0].__setitem__("layers", [3]),
        lambda d: d.__setitem__("baseline_loss", "0.7"),
        lambda d: d.__setitem__("method", "exec"),
        lambda d: d["groups"][0]["prune"].__setitem__(0, [0.5]),
    ]
    for edit in edits:
        data = json.loads(text)
        edit(data)
        with pytest.raises(ValueError, match="sensitivity"):
            SensitivityInfo.from_json(json.loads(json.dumps(data)))


class _TanhMLP(torch.nn.Module):
    """8 -> tanh(16) -> 3: a layer with curvature of its own (a ReLU net's Hessian is its Gauss-Newton matrix)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def test_hessian_trace_is_the_gauss_newton_block_trace() -> None:
    """hessian_trace's estimate is 0.5 * Tr(G_ll) / n * ||dW||^2 with G_ll = J^T H_z J the layer's Gauss-Newton
    block (exact here: autograd jacobian of the logits, hessian of the loss in the logits), within Hutchinson's
    error; it stays positive where the full Hessian block's trace is negative (this model's fc1)."""
    torch.manual_seed(1)
    mg = ForgeGraph(_TanhMLP().eval(), (torch.randn(4, 8),))
    batches, w1 = _mlp_batches(), mg.model.fc1.weight.detach()

    def logits_of(w: torch.Tensor, b: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.func.functional_call(mg.model, {"fc1.weight": w}, (b["x"],))

    def loss_of(w: torch.Tensor, b: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits_of(w, b), b["labels"])

    hessian = gauss_newton = 0.0
    for b in batches:
        hessian += float(torch.autograd.functional.hessian(functools.partial(loss_of, b=b), w1)
                         .reshape(w1.numel(), -1).diagonal().sum()) / len(batches)
        jac = torch.autograd.functional.jacobian(functools.partial(logits_of, b=b), w1).reshape(-1, w1.numel())
        h_z = torch.autograd.functional.hessian(lambda z, b=b: torch.nn.functional.cross_entropy(z, b["labels"]),
                                                logits_of(w1, b)).reshape(jac.shape[0], -1)
        gauss_newton += float(torch.trace(jac.T @ h_z @ jac)) / len(batches)
    assert hessian < 0 < gauss_newton  # the case the Gauss-Newton block exists for
    _, info = passes.sensitivity_analysis_pass(mg, {"data": batches, "method": "hessian_trace", "widths": [3],
                                                    "probes": 100})
    dw1 = float(((quantized_weight(w1, weight_spec("integer", 3, None)) - w1) ** 2).sum())
    assert info.layers[0].name == "fc1"
    assert info.layers[0].delta(3) == pytest.approx(0.5 * gauss_newton / w1.numel() * dw1, rel=0.15)
    assert all(d > 0 for s in info.layers for _, d in s.quant)


def test_loss_method_is_the_measured_calibration_loss(mlp: ForgeGraph) -> None:
    """method "loss": each layer's entry is the calibration loss with that layer alone quantized by
    quantize_transform_pass, minus the float graph's (measured, not estimated)."""
    batches = _mlp_batches()
    _, info = passes.sensitivity_analysis_pass(mlp, {"data": batches, "method": "loss", "widths": [2, 4]})

    def mean_loss(g: ForgeGraph) -> float:
        with torch.no_grad():
            return sum(float(torch.nn.functional.cross_entropy(g(b["x"]), b["labels"])) for b in batches) / 2

    assert info.method == "loss" and info.baseline_loss == pytest.approx(mean_loss(mlp), abs=1e-6)
    for s in info.layers:
        for width in (2, 4):
            config = {"name": "integer", "weight_width": width, "weight_frac_width": "auto"}
            q, _ = passes.quantize_transform_pass(mlp, {"by": "name", s.name: {"config": config}})
            assert s.delta(width) == pytest.approx(mean_loss(q) - info.baseline_loss, abs=1e-6)
    assert SensitivityInfo.from_json(json.loads(json.dumps(info.to_json()))) == info
