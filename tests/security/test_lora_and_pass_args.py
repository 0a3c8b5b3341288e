"""LoRA adapter checkpoint attacks and bad pass arguments (issue 8): each is a clean, named error."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
import torch.nn as nn
from security_helpers import edit_json, fresh_copy, rewrite, tiny_graph

from fxforge import ForgeGraph, passes
from fxforge.passes.base import PassArgsError
from fxforge.passes.lora_checkpoint import CONFIG, WEIGHTS, LoraCheckpointError, load_lora_adapters, save_lora_adapters


@pytest.fixture(scope="module")
def base() -> ForgeGraph:
    return tiny_graph("fx")


@pytest.fixture(scope="module")
def pristine(base: ForgeGraph, tmp_path_factory: pytest.TempPathFactory) -> Path:
    mg = base.copy()
    mg, _ = passes.insert_lora_adapter_transform_pass(mg, {"rank": 2, "targets": {"name": ["fc", "out"]}})
    return save_lora_adapters(mg, tmp_path_factory.mktemp("lora") / "adapters")


@pytest.fixture
def adapters(pristine: Path, tmp_path: Path) -> Path:
    return fresh_copy(pristine, tmp_path)


def _state(mg: ForgeGraph) -> tuple[list[str], dict[str, bool]]:
    return ([type(m).__name__ for m in mg.model.modules()],
            {n: p.requires_grad for n, p in mg.model.named_parameters()})


def _refused(base: ForgeGraph, path: Path, match: str) -> None:
    mg = base.copy()
    before = _state(mg)
    with pytest.raises(LoraCheckpointError, match=match):
        load_lora_adapters(mg, path)
    assert _state(mg) == before  # nothing inserted, nothing frozen


@pytest.mark.parametrize("name", ["manifest.json", CONFIG])
def test_deeply_nested_adapter_json_is_a_clean_error(base: ForgeGraph, adapters: Path, name: str) -> None:
    deep = b"{\"a\":" * 50_000 + b"1" + b"}" * 50_000
    if name == CONFIG:
        rewrite(adapters, name, deep)
    else:
        (adapters / name).write_bytes(deep)
    _refused(base, adapters, "nested .* deep")


@pytest.mark.parametrize("alpha", [1e308, 1e7])
def test_absurd_alpha_is_refused(base: ForgeGraph, adapters: Path, alpha: float) -> None:
    edit_json(adapters, CONFIG, lambda c: c["layers"][0].__setitem__("alpha", alpha))
    _refused(base, adapters, "alpha .* is outside")


def test_non_finite_adapter_weights_are_refused(base: ForgeGraph, adapters: Path) -> None:
    weights = safetensors.torch.load((adapters / WEIGHTS).read_bytes())
    weights["fc.lora_B"][0, 0] = float("nan")
    rewrite(adapters, WEIGHTS, safetensors.torch.save(weights))
    _refused(base, adapters, "not finite")


def test_same_layer_twice_is_refused_before_touching_the_graph(base: ForgeGraph, adapters: Path) -> None:
    def edit(c: dict[str, Any]) -> None:
        twin = dict(c["layers"][0], dropout=0.5)
        c["layers"].append(twin)
    edit_json(adapters, CONFIG, edit)
    _refused(base, adapters, "listed twice")


def test_rank_beyond_the_layer_is_refused(base: ForgeGraph, adapters: Path) -> None:
    edit_json(adapters, CONFIG, lambda c: c["layers"][0].__setitem__("rank", 2**40))
    _refused(base, adapters, "exceeds the layer's smaller dimension")


def test_duplicate_keys_in_adapter_config(base: ForgeGraph, adapters: Path) -> None:
    text = (adapters / CONFIG).read_text()
    rewrite(adapters, CONFIG, text.replace('"extras": [', '"extras": [], "extras": [', 1).encode())
    _refused(base, adapters, "duplicate key 'extras'")


def test_symlinked_adapter_file_is_refused(base: ForgeGraph, adapters: Path, tmp_path: Path) -> None:
    (tmp_path / "copy").write_bytes((adapters / WEIGHTS).read_bytes())
    (adapters / WEIGHTS).unlink()
    (adapters / WEIGHTS).symlink_to(tmp_path / "copy")
    _refused(base, adapters, "symbolic link")


def test_adapter_schema_version_is_exact(base: ForgeGraph, adapters: Path) -> None:
    manifest = json.loads((adapters / "manifest.json").read_text())
    manifest["schema_version"] = True
    (adapters / "manifest.json").write_text(json.dumps(manifest))
    _refused(base, adapters, "schema version True is not supported")


# 7. pass arguments ---------------------------------------------------------------------------------------
def test_mixed_key_types_name_the_key(base: ForgeGraph) -> None:
    with pytest.raises(PassArgsError, match=r"pass_args key 1 \(int\) is not a string"):
        passes.insert_lora_adapter_transform_pass(base.copy(), {1: 2, "rank": 3})


def _batches():
    for _ in range(2):
        yield {"x": torch.randn(2, 4)}


def test_generator_data_is_passed_by_reference(base: ForgeGraph) -> None:
    from fxforge.passes.base import build_args
    from fxforge.passes.quantize.calibrate import CalibrateArgs

    gen = _batches()
    args = build_args("calibrate_analysis_pass", CalibrateArgs, {"data": gen})
    assert args.data is gen


def test_configuration_is_copied_and_uncopyable_config_is_named() -> None:
    from fxforge.passes.base import build_args
    from fxforge.passes.select import Selector
    from fxforge.passes.transform.lora import LoraArgs

    targets = {"name": ["fc"]}
    args = build_args("lora", LoraArgs, {"targets": targets})
    assert args.targets == Selector(names=("fc",)) and targets == {"name": ["fc"]}  # parsed; the caller's dict kept
    with pytest.raises(PassArgsError, match=r"pass_args\['targets'\] \(lock\) cannot be copied"):
        build_args("lora", LoraArgs, {"targets": threading.Lock()})


@pytest.mark.parametrize("value", [-1, 0, 10**100])
def test_num_batches_out_of_range(value: int) -> None:
    from fxforge.passes.base import build_args
    from fxforge.passes.quantize.calibrate import CalibrateArgs

    with pytest.raises(PassArgsError, match=r"pass_args\['num_batches'\] = .* is out of range"):
        build_args("calibrate_analysis_pass", CalibrateArgs, {"num_batches": value})


def test_lora_rank_beyond_the_layer_is_refused_before_touching_the_graph(base: ForgeGraph) -> None:
    mg = base.copy()
    before = _state(mg)
    with pytest.raises(PassArgsError, match=r"pass_args\['rank'\] = 1099511627776 exceeds the smaller dimension"):
        passes.insert_lora_adapter_transform_pass(mg, {"rank": 2**40})
    assert _state(mg) == before


@pytest.mark.parametrize("selector", [int, dict, {"type": [nn.Linear, str]}, {"predicate": int}])
def test_non_module_classes_are_not_selectors(base: ForgeGraph, selector: Any) -> None:
    with pytest.raises(PassArgsError, match="'targets'"):
        passes.insert_lora_adapter_transform_pass(base.copy(), {"targets": selector})


# issue 26, item 4: an adapter holds its own trainable tensors only ------------------------------------------
def _add_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    weights = safetensors.torch.load((path / WEIGHTS).read_bytes())
    rewrite(path, WEIGHTS, safetensors.torch.save({**weights, **tensors}))


def test_extras_naming_an_unrelated_base_weight_are_refused(base: ForgeGraph, tmp_path: Path) -> None:
    mg, _ = passes.insert_lora_adapter_transform_pass(base.copy(), {"rank": 2, "targets": {"name": ["fc"]}})
    path = save_lora_adapters(mg, tmp_path / "fc-only")
    edit_json(path, CONFIG, lambda c: c["extras"].append("out.weight"))
    _add_tensors(path, {"out.weight": torch.zeros(3, 8)})
    _refused(base, path, r"'out.weight'")


def test_base_weights_listed_as_extras_stay_in_the_fingerprint(base: ForgeGraph, adapters: Path) -> None:
    import hashlib

    def edit(c: dict[str, Any]) -> None:
        c["extras"] += ["fc.base.weight", "fc.base.bias"]
        c["layers"][0]["base_sha256"] = hashlib.sha256(b"").hexdigest()  # the fingerprint of nothing
    edit_json(adapters, CONFIG, edit)
    _add_tensors(adapters, {"fc.base.weight": torch.zeros(8, 4), "fc.base.bias": torch.zeros(8)})
    _refused(base, adapters, r"fc: base weights differ")  # the fingerprint still covers fc's weight and bias
    with pytest.raises(LoraCheckpointError, match=r"\['fc.base.bias', 'fc.base.weight'\] are not theirs"):
        load_lora_adapters(base.copy(), adapters, check_base=False)  # and never are extras


@pytest.mark.parametrize("kept", ["fc", "fc.base", "", "nowhere"])
def test_modules_to_save_cannot_reach_an_adapted_layer(base: ForgeGraph, adapters: Path, kept: str) -> None:
    def edit(c: dict[str, Any]) -> None:
        c["modules_to_save"] = [kept]
    edit_json(adapters, CONFIG, edit)
    _refused(base, adapters, "modules_to_save")


def test_modules_to_save_round_trip(base: ForgeGraph, tmp_path: Path) -> None:
    mg, _ = passes.insert_lora_adapter_transform_pass(base.copy(), {"rank": 2, "targets": {"name": ["fc"]},
                                                                    "trainable": {"name": ["out"]}})
    with torch.no_grad():
        mg.model.fc.lora_B.normal_(generator=torch.Generator().manual_seed(1))
        mg.model.out.weight.add_(1.0)
    path = save_lora_adapters(mg, tmp_path / "kept")
    config = json.loads((path / CONFIG).read_text())
    assert config["modules_to_save"] == ["out"] and config["extras"] == ["out.weight", "out.bias"]
    loaded, info = load_lora_adapters(base.copy(), path)
    x = torch.randn(2, 4)
    assert torch.equal(loaded(x=x), mg(x=x)) and info["modules_to_save"] == ["out"]
    assert {n for n, p in loaded.model.named_parameters() if p.requires_grad} == {
        "fc.lora_A", "fc.lora_B", "out.weight", "out.bias"}


def test_a_trained_base_weight_of_an_adapted_layer_is_not_saved_as_an_extra(base: ForgeGraph, tmp_path: Path) -> None:
    mg, _ = passes.insert_lora_adapter_transform_pass(base.copy(), {"rank": 2, "targets": {"name": ["fc", "out"]}})
    mg.model.fc.base.bias.requires_grad_(True)
    with pytest.raises(LoraCheckpointError, match=r"fc.base.bias.*modules_to_save"):
        save_lora_adapters(mg, tmp_path / "bitfit")
    assert not (tmp_path / "bitfit").exists()
