"""MASE quantization config: validation (errors list the allowed values) and non-mutation."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from fxforge.passes.base import PASSES, PassArgsError
from fxforge.passes.quantize.config import OpQuantConfig, QuantizeConfig
from fxforge.passes.quantize.formats import QuantizeConfigError

MASE = {"by": "type", "default": {"config": {"name": None}},
        "linear": {"config": {"name": "integer", "data_in_width": 8, "data_in_frac_width": 4, "weight_width": 8,
                              "weight_frac_width": 4, "bias_width": 8, "bias_frac_width": 4}}}


def _with(**linear: Any) -> dict[str, Any]:
    cfg = copy.deepcopy(MASE)
    cfg["linear"]["config"].update(linear)
    return cfg


def test_mase_config_parses_and_is_not_mutated() -> None:
    original = copy.deepcopy(MASE)
    cfg = QuantizeConfig.from_dict(MASE)
    assert MASE == original
    assert cfg.by == "type" and cfg.default is None
    key, op_cfg = cfg.rule_for("bert.encoder.layer.0.attention.self.query", "linear")
    assert key == "linear" and op_cfg is not None
    assert op_cfg.role_names == ("data_in", "weight", "bias")
    assert op_cfg.role("weight").p == {"width": 8, "frac_width": 4}  # type: ignore[union-attr]
    assert cfg.rule_for("x", "relu") == (None, None)
    assert QuantizeConfig.from_dict(cfg.to_json()) == cfg  # the filled-in form round-trips


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        (_with(name="integr"), r"unknown quantization format 'integr'; allowed: \['block_fp', 'integer'"),
        (_with(data_in_widht=8), r"unknown key\(s\) \['data_in_widht'\] for format 'integer'; allowed: "
                                 r"\['name', 'bypass', 'data_in_width', 'data_in_frac_width'"),
        (_with(weight_frac_width=None), r"weight_frac_width must be of type int or one of \['auto'\], got None"),
        (_with(data_in_width=True), r"data_in_width must be of type int, got True"),
        (_with(data_in_width=1), r"data_in_width = 1 is outside \[2, 32\]"),
        ({"by": "types"}, r"'by' must be one of \['type', 'name', 'regex'\]"),
        ({"by": "type", "linaer": {"config": {"name": None}}}, r"unknown op type 'linaer'.*'linear'"),
        ({"by": "regex", "(": {"config": {"name": None}}}, r"regex key '\(' is invalid"),
        ({"linear": {"name": "integer"}}, r"must be \{'config': \{...\}\}"),
        ({"linear": {"config": {"name": "integer", "data_in_width": 8}}}, r"needs \['frac_width'\]"),
        ({"linear": {"config": {"name": "integer"}}}, r"is given for no role"),
        ({"linear": {"config": {"name": None, "data_in_width": 8}}}, r"name is None .* keys \['data_in_width'\]"),
        ({"linear": {"config": {"name": "minifloat", "data_in_width": 8, "data_in_exponent_width": 4,
                                "data_in_special": "ocp"}}}, r"data_in_special = 'ocp' is not allowed; allowed: "
                                                             r"\['ieee', 'fn', 'none'\]"),
        ({"linear": {"config": {"name": "minifloat", "weight_width": 4, "weight_exponent_width": 4}}},
         r"leaves no room"),
        ({"linear": {"config": {"name": "mxfp", "weight_width": 8, "weight_exponent_width": 3}}},
         r"OCP MX defines"),
        ({"linear": {"config": {"name": "scaled_integer", "data_in_width": 8, "data_in_granularity": "row"}}},
         r"allowed: \['per_tensor', 'per_channel'\]"),
        # parameters checked against each other
        (_with(weight_frac_width=9), r"weight: frac_width 9 > width 8: .*at most width fraction bits"),
        ({"linear": {"config": {"name": "block_fp", "weight_width": 8, "weight_exponent_width": 4,
                                "weight_exponent_bias": 200}}}, r"exponent range \[-200, -185\].*float32"),
    ],
)
def test_invalid_configs_name_the_key_and_allowed_values(cfg: dict[str, Any], message: str) -> None:
    before = copy.deepcopy(cfg)
    with pytest.raises(QuantizeConfigError, match=message):
        QuantizeConfig.from_dict(cfg)
    assert cfg == before


def test_defaults_filled_and_bypass() -> None:
    op = OpQuantConfig.parse({"name": "scaled_integer", "weight_width": 8}, "cfg")
    assert op is not None and op.role("weight").p == {  # type: ignore[union-attr]
        "width": 8, "symmetric": True, "granularity": "per_tensor", "dynamic": False}
    assert OpQuantConfig.parse({"name": "integer", "bypass": True, "data_in_width": 8, "data_in_frac_width": 2},
                               "cfg") is None
    mx = OpQuantConfig.parse({"name": "mxint", "data_in_width": 8}, "cfg")
    assert mx is not None and mx.role("data_in").bits == 8.25  # type: ignore[union-attr]


def test_name_and_regex_lookup_first_match_wins() -> None:
    entry = {"config": {"name": "integer", "data_in_width": 8, "data_in_frac_width": 4}}
    cfg = QuantizeConfig.from_dict({"by": "name", "query": entry, "layer.0.attention.self.query": {"config": {
        "name": None}}})
    assert cfg.rule_for("bert.encoder.layer.0.attention.self.query", "linear")[0] == "query"
    cfg = QuantizeConfig.from_dict({"by": "regex", r".*layer\.1\..*": entry})
    assert cfg.rule_for("bert.encoder.layer.1.output.dense", "linear")[1] is not None
    assert cfg.rule_for("bert.encoder.layer.11.output.dense", "linear") == (None, None)


def test_pass_wrapper_reports_pass_args_errors() -> None:
    from fxforge.passes.quantize import quantize_transform_pass

    assert PASSES["quantize_transform_pass"] is quantize_transform_pass
    with pytest.raises(PassArgsError, match="quantize_transform_pass: unknown quantization format"):
        quantize_transform_pass(None, _with(name="posit"))  # type: ignore[arg-type]
