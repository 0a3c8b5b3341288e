"""The tensor-parallel plan read off a captured graph (no process group): which layers are split column-wise
and row-wise on tiny BERT, tiny Llama (GQA, gated MLP) and the zoo GPT (fused q/k/v), and the refusal of a
world size that does not divide a layer's heads."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.nn as nn
from conftest import make_gpt, make_tiny_bert
from hf_tiny import tiny_hf

from fxforge import ForgeGraph
from fxforge.distributed import TensorParallelError, VocabLayers, localize_graph, tensor_parallel_plan


@pytest.fixture(scope="module")
def graphs() -> dict[str, ForgeGraph]:
    return {"bert": ForgeGraph(make_tiny_bert(), hf_input_names=["input_ids", "attention_mask"]).eval(),
            "llama": ForgeGraph(tiny_hf("llama"), hf_input_names=["input_ids", "attention_mask"]).eval(),
            "gpt": ForgeGraph(make_gpt(), example_inputs=(torch.randint(0, 64, (2, 16)),)).eval()}


def test_bert_qkv_and_ffn_up_colwise_output_and_down_rowwise(graphs: dict[str, ForgeGraph]) -> None:
    plan = tensor_parallel_plan(graphs["bert"], 2)
    layer = "bert.encoder.layer.{}."
    assert set(plan.colwise) == {layer.format(i) + p for i in (0, 1) for p in
                                 ("attention.self.query", "attention.self.key", "attention.self.value",
                                  "intermediate.dense")}
    assert set(plan.rowwise) == {layer.format(i) + p for i in (0, 1)
                                 for p in ("attention.output.dense", "output.dense")}
    assert [(b.kind, b.groups) for b in plan.blocks] == [("attention", 4)] * 2 + [("ffn", 64)] * 2
    assert plan.row_order == {} and plan.col_order == {}  # separate q/k/v layers: contiguous shards already
    # rank 0 keeps heads 0-1 of every attention: rows 0-15 of q/k/v (head size 8), and FFN units 0-31
    dep = plan.dep
    for path, rows in ((layer.format(0) + "attention.self.key", 32), (layer.format(1) + "intermediate.dense", 64)):
        kept = [r for r in range(rows) if not plan.elsewhere[0, dep.unit_of[(path, r)]]]
        assert kept == list(range(rows // 2))


def test_llama_gqa_and_gated_mlp(graphs: dict[str, ForgeGraph]) -> None:
    plan = tensor_parallel_plan(graphs["llama"], 2)
    assert set(plan.colwise) == {f"model.layers.{i}.{p}" for i in (0, 1) for p in
                                 ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                                  "mlp.up_proj")}
    assert set(plan.rowwise) == {f"model.layers.{i}.{p}" for i in (0, 1) for p in ("self_attn.o_proj", "mlp.down_proj")}
    attention = [b for b in plan.blocks if b.kind == "attention"]
    assert [b.groups for b in attention] == [2, 2]  # 4 query heads share 2 key/value heads
    with pytest.raises(TensorParallelError, match=r"'scaled_dot_product_attention' \(layers "
                                                  r"model\.layers\.0\.self_attn\.k_proj.*has 4 heads in 2 key/value "
                                                  r"groups, which 4 ranks cannot share evenly"):
        tensor_parallel_plan(graphs["llama"], 4)


def test_gpt_fused_qkv_rows_are_reordered_per_rank(graphs: dict[str, ForgeGraph]) -> None:
    plan = tensor_parallel_plan(graphs["gpt"], 2)
    assert set(plan.colwise) == {f"blocks.{i}.{p}" for i in (0, 1) for p in ("mixer.c_attn", "mlp.c_fc")}
    assert set(plan.rowwise) == {f"blocks.{i}.{p}" for i in (0, 1) for p in ("mixer.c_proj", "mlp.c_proj")}
    # c_attn's rows are [q | k | v] (32 each, 2 heads of 16): rank 0 takes head 0 of each, rank 1 head 1
    head = [list(range(s, s + 16)) for s in (0, 32, 64, 16, 48, 80)]
    assert plan.row_order == {f"blocks.{i}.mixer.c_attn": tuple(sum(head, [])) for i in (0, 1)}


@pytest.mark.parametrize(("model", "world", "layer"), [
    ("bert", 3, r"attention 'bert_encoder_layer_0_attention_self_sdpa' \(layers "
                r"bert\.encoder\.layer\.0\.attention\.self\.key, .*\) has 4 heads, which 3 ranks"),
    ("gpt", 4, r"attention 'scaled_dot_product_attention' \(layers blocks\.0\.mixer\.c_attn\) has 2 heads, which 4"),
])
def test_heads_not_divisible_are_refused_naming_the_layer(graphs: dict[str, ForgeGraph], model: str, world: int,
                                                          layer: str) -> None:
    with pytest.raises(TensorParallelError, match=layer + ".*use a world size that divides"):
        tensor_parallel_plan(graphs[model], world)


def test_large_embeddings_and_vocabulary_heads_are_split_by_rows(graphs: dict[str, ForgeGraph]) -> None:
    assert tensor_parallel_plan(graphs["gpt"], 2).vocab == VocabLayers(("wte",), ("lm_head",))
    assert tensor_parallel_plan(graphs["llama"], 2).vocab == VocabLayers(("model.embed_tokens",), ("lm_head",))
    # tiny BERT: its word and 64 position rows are each over 1 % of the parameters; the 2 token types and the
    # 2-way classifier (no table's vocabulary) stay whole
    assert tensor_parallel_plan(graphs["bert"], 2).vocab == VocabLayers(
        ("bert.embeddings.word_embeddings", "bert.embeddings.position_embeddings"), ())
    assert tensor_parallel_plan(graphs["gpt"], 2, vocab_parallel=False).vocab == VocabLayers()


def _tied(model: nn.Module) -> None:
    model.lm_head.weight = model.wte.weight


def _renormalised(model: nn.Module) -> None:
    model.wte.max_norm = 1.0


@pytest.mark.parametrize(("change", "message"), [
    (_tied, r"embedding 'wte' shares its weight with lm_head\.weight \(tied weights\)"),
    (_renormalised, r"embedding 'wte' renormalises the rows it looks up \(max_norm=1\.0\)"),
])
def test_an_embedding_that_cannot_be_split_is_kept_whole_or_refused_naming_it(change: Any, message: str) -> None:
    model = make_gpt()
    change(model)
    mg = ForgeGraph(model, example_inputs=(torch.randint(0, 64, (2, 16)),)).eval()
    with pytest.raises(TensorParallelError, match=message + r".*vocab_parallel=False"):
        tensor_parallel_plan(mg, 2, vocab_parallel=True)
    assert tensor_parallel_plan(mg, 2, vocab_parallel=False).vocab == VocabLayers()
    auto = tensor_parallel_plan(mg, 2).vocab  # the default: the table (and a head tied to it) stays whole, said why
    assert auto.embeddings == () and "wte" not in auto.heads and "lm_head" not in auto.heads
    assert [path for path, _ in auto.whole] == ["wte"] and re.search(message, auto.whole[0][1])


def test_vocab_parallel_must_be_a_bool_or_auto(graphs: dict[str, ForgeGraph]) -> None:
    with pytest.raises(TensorParallelError, match="vocab_parallel must be True, False or 'auto', got 'yes'"):
        tensor_parallel_plan(graphs["gpt"], 2, vocab_parallel="yes")  # type: ignore[arg-type]


def _sizes(mg: ForgeGraph, name: str) -> list[object]:
    """The literal (int) arguments of node ``name``; symbolic sizes as None."""
    node = mg.node(name)
    flat = [a for arg in node.args[1:] for a in (arg if isinstance(arg, list | tuple) else [arg])]
    return [a if isinstance(a, int) else None for a in flat]


def test_local_graph_has_one_ranks_head_count_and_split(graphs: dict[str, ForgeGraph]) -> None:
    gpt = graphs["gpt"].copy()
    weight = gpt.model.get_submodule("blocks.0.mixer.c_attn").weight.detach().clone()
    assert (_sizes(gpt, "split"), _sizes(gpt, "reshape"), _sizes(gpt, "reshape_3")) == (
        [32], [None, None, 2, 16], [None, None, 32])
    localize_graph(gpt, tensor_parallel_plan(gpt, 2), rank=1)
    assert (_sizes(gpt, "split"), _sizes(gpt, "reshape"), _sizes(gpt, "reshape_3")) == (
        [16], [None, None, 1, 16], [None, None, 16])  # one head of 16 channels per rank; q, k, v 16 rows each
    shard = gpt.model.get_submodule("blocks.0.mixer.c_attn").weight[48:]  # rank 1's contiguous rows: head 1
    assert torch.equal(shard, torch.cat([weight[16:32], weight[48:64], weight[80:96]]))
    llama = graphs["llama"].copy()
    expand = next(n.name for n in llama.nodes if n.name.startswith("expand") and len(_sizes(llama, n.name)) == 5)
    assert _sizes(llama, expand) == [None, 2, 2, None, 8]  # GQA: 2 key/value heads repeated twice
    localize_graph(llama, tensor_parallel_plan(llama, 2), rank=0)
    assert _sizes(llama, expand) == [None, 1, 2, None, 8]
    assert _sizes(llama, llama.node(expand).next.name) == [None, 2, None, 8]  # 2 of the 4 query heads


class _ChunkedQKV(nn.Module):
    """Attention with a fused q/k/v split by ``chunk`` (4 heads of 4) and a bias-free output projection."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(16, 48), nn.Linear(16, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s = x.size(0), x.size(1)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        heads = [t.reshape(b, s, 4, 4).transpose(1, 2) for t in (q, k, v)]
        y = torch.nn.functional.scaled_dot_product_attention(*heads)
        return self.proj(y.transpose(1, 2).reshape(b, s, 16))


def test_local_graphs_of_all_ranks_sum_to_the_whole_output() -> None:
    """Each rank's localized graph on its weight shards gives a partial sum of the row-wise projection (what
    RowwiseParallel all-reduces): the ranks' outputs add up to the single-process output."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 16)
    mg = ForgeGraph(_ChunkedQKV().eval(), example_inputs=(x,))
    plan = tensor_parallel_plan(mg, 2)
    assert (plan.colwise, plan.rowwise) == (("qkv",), ("proj",))
    with torch.no_grad():
        whole, total = mg(x), torch.zeros(2, 5, 16)
        for rank in range(2):
            local = localize_graph(mg.copy(), plan, rank)
            qkv, proj = local.model.get_submodule("qkv"), local.model.get_submodule("proj")
            qkv.weight, qkv.bias = (nn.Parameter(t.chunk(2)[rank]) for t in (qkv.weight, qkv.bias))
            proj.weight = nn.Parameter(proj.weight.chunk(2, dim=1)[rank])
            total += local(x)
    assert (total - whole).abs().max() <= 1e-6


def test_masked_layers_are_refused_naming_one(graphs: dict[str, ForgeGraph]) -> None:
    from fxforge.passes.prune import prune_transform_pass

    pruned, _ = prune_transform_pass(graphs["gpt"].copy(), {"weight": {"sparsity": 0.25, "granularity": "ffn"}})
    with pytest.raises(TensorParallelError, match=r"layer 'blocks\.0\.mlp\.c_fc' is a PrunedLinear, not a plain "
                                                  r"Linear: .*shrink first"):
        tensor_parallel_plan(pruned, 2)
