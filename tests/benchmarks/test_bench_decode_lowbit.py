"""bench_decode_lowbit on a tiny Llama (--quick): the decode step it times is the model's real next-token
step, the hand-made ATen low-bit linears compute their stated dequantized weights, the bytes-per-token
floor counts what a step reads, and one quick run reports every variant (or why it did not run). Timings are
printed, never asserted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

from fxforge.benchmarks.bench_decode_lowbit import FORMATS, bytes_per_token, main
from fxforge.benchmarks.decode_models import (
    LLAMA_TINY,
    AtenInt4Linear,
    AtenInt8Linear,
    EagerDecode,
    build_llama,
    prefill_kv,
    swap_linears,
)


@pytest.fixture(scope="module")
def llama() -> nn.Module:
    return build_llama(LLAMA_TINY, seed=0)


def test_static_cache_step_is_the_next_token_forward_and_repeats_identically(llama: nn.Module) -> None:
    prompts = torch.randint(0, LLAMA_TINY["vocab_size"], (3, 13), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        full = llama(prompts).logits[:, -1]
    kv = prefill_kv(llama, prompts[:, :12], chunk=2)
    dec = EagerDecode(llama, 12)
    for i in range(3):
        dec.load(kv, i, int(prompts[i, -1]))
        first, again = dec.step(), dec.step()
        torch.testing.assert_close(first, full[i], rtol=0, atol=1e-5)
        assert torch.equal(first, again)  # the cache is rewound: the second call does the same work


def test_aten_linears_compute_their_dequantized_weights() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(256, 96)
    x = torch.randn(3, 256)
    w = lin.weight.detach()
    s8 = w.abs().amax(1, keepdim=True) / 127
    ref8 = x @ (torch.round(w / s8) * s8).t() + lin.bias
    torch.testing.assert_close(AtenInt8Linear(lin)(x), ref8, rtol=0, atol=1e-4)
    g = w.reshape(96, 2, 128)
    s4 = g.abs().amax(-1, keepdim=True) / 7
    w4 = (torch.clamp(torch.round(g / s4), -8, 7) * s4).reshape(96, 256)
    fp32_act = AtenInt4Linear(lin, 128, act_dtype=torch.float32)(x)
    torch.testing.assert_close(fp32_act, x @ w4.t() + lin.bias, rtol=0, atol=1e-4)
    assert (AtenInt4Linear(lin, 128)(x) - fp32_act).abs().max() < 0.05  # bf16 activations and scales
    with pytest.raises(ValueError, match="multiple of the group size"):
        AtenInt4Linear(nn.Linear(96, 8), 128)


def test_swap_linears_replaces_every_linear_on_a_copy(llama: nn.Module) -> None:
    q = swap_linears(llama, AtenInt8Linear)
    assert not any(type(m) is nn.Linear for m in q.modules())
    assert sum(isinstance(m, AtenInt8Linear) for m in q.modules()) == 7 * LLAMA_TINY["num_hidden_layers"] + 1
    assert any(type(m) is nn.Linear for m in llama.modules())  # the original is untouched


def test_bytes_per_token_counts_linears_scales_norms_one_embedding_row_and_the_cache(llama: nn.Module) -> None:
    h, n, i, v = (LLAMA_TINY[k] for k in ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size"))
    linear = n * (4 * h * h + 3 * h * i) + v * h
    rows = n * (4 * h + 2 * i + h) + v
    small = (2 * n + 1) * h + h  # RMSNorm weights and the one embedding row
    kv = 2 * n * h * 17  # keys and values of 16 cached tokens + the new one (no GQA here)
    assert bytes_per_token(llama, FORMATS["fp32"], 16) == 4 * (linear + small + kv)
    assert bytes_per_token(llama, FORMATS["bf16"], 16) == 2 * (linear + small + kv)
    assert bytes_per_token(llama, FORMATS["int8"], 16) == linear + 4 * rows + 4 * (small + kv)
    assert bytes_per_token(llama, FORMATS["int4"], 16) == linear / 2 + 4 * linear / 128 + 4 * (small + kv)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    path = tmp_path_factory.mktemp("bench") / "decode.json"
    result = main(["--quick", "--json", str(path)])
    assert json.loads(Path(path).read_text())["variants"].keys() == result["variants"].keys()
    return result


def test_quick_run_reports_every_variant_or_why_it_did_not_run(quick_run: dict[str, Any]) -> None:
    expected = {"fp32-eager", "bf16-eager", "aten-int8", "aten-int4", "torchao-int8", "torchao-int4",
                "fxforge-fp32", "fxforge-int8", "fxforge-int4"}
    ran, failed = set(quick_run["variants"]), set(quick_run["errors"])
    assert ran | failed == expected and not ran & failed
    assert {"fp32-eager", "bf16-eager", "aten-int8", "aten-int4", "fxforge-fp32", "fxforge-int8",
            "fxforge-int4"} <= ran
    assert all(text for text in quick_run["errors"].values())  # every missing variant says why
    for name, row in quick_run["variants"].items():
        assert row["ms"] > 0 and row["ratio"] > 0 and row["floor_ratio"] > 0, name
        assert (row["target"] is None) == (name not in ("fxforge-int8", "fxforge-int4"))
    assert quick_run["variants"]["fp32-eager"]["ratio"] == 1.0


def test_quick_run_floor_is_ordered_by_width(quick_run: dict[str, Any]) -> None:
    floor = quick_run["floor_ms"]
    assert floor["fp32"] > floor["bf16"] > floor["int8"] > floor["int4-32"] > floor["int4"] > 0
    assert quick_run["bandwidth_gbs"] > 0


def test_quick_run_agreement_is_counted_against_fp32_with_margins(quick_run: dict[str, Any]) -> None:
    agree = quick_run["agreement"]
    assert agree["prompts"] == 8
    assert agree["same_top1"]["fp32-eager"] == 8 and agree["max_abs_logit_err"]["fp32-eager"]["max"] == 0
    m = agree["fp32_margin"]
    assert 0 <= m["min"] <= m["p10"] <= m["median"] <= m["max"]
    for name in quick_run["variants"]:
        same, different = agree["same_top1"][name], agree["fp32_margin_where_different"][name]
        assert same + len(different) == 8, name
        assert all(margin <= 2 * agree["max_abs_logit_err"][name]["max"] for margin in different), name
        if name not in ("fp32-eager", "fxforge-fp32"):
            assert 0 < agree["max_abs_logit_err"][name]["max"] < 1, name  # rounded, not broken
    # the captured static-cache graph computes the eager step (same ops; only summation order may differ)
    assert agree["same_top1"]["fxforge-fp32"] == 8 and agree["max_abs_logit_err"]["fxforge-fp32"]["max"] < 1e-5
