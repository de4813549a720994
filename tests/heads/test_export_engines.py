"""`selfdraft export` checked against how the engines define what they load (issue 41, defects a-d, item 4).

The engines' definitions followed (read from their sources, vLLM 0.32 / SGLang 0.5.23 / speculators 0.9):
    vLLM  vllm/model_executor/models/llama_eagle3.py: the draft is Llama layers; layer 0's qkv_proj
          reads 2h and has a bias only when config `attention_bias` (or `bias`, or `qkv_bias`) is set,
          o_proj's bias follows `attention_bias`/`bias`, the MLP's `mlp_bias`; fc: 3*target_hidden -> h
          without bias; d2t is draft_id_to_target_id; embed_tokens.weight is loaded when the file has it.
          The target captures the INPUT of each layer in eagle_aux_hidden_state_layer_ids (0 included).
    SGLang python/sglang/srt/models/llama_eagle3.py + llama.py: `midlayer.` is layer 0, fc bias from
          config `bias`, config `norm_output` feeds the post-norm state back; the target captures the
          input of layer id + 1 for each eagle_aux_hidden_state_layer_ids entry.
    speculators  an Eagle3 draft without embed_tokens.weight starts from an all-zero embedding (its
          model's embedding is only filled from the file).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from test_interop import TINY, llama_target
from test_interop_engines import ref_eagle3
from transformers import AutoModelForCausalLM, Qwen2Config

from selfdraft.heads import HeadsConfig, build_heads, load_heads, save_heads
from selfdraft.heads.eagle3.export import ExportError, engine_config, export_heads
from selfdraft.scripts import cli
from selfdraft.target import EMBEDDED, prepare_target

H, V, VD = TINY["hidden"], TINY["vocab"], TINY["draft_vocab"]
_TARGET = {}


def _target():
    if "t" not in _TARGET:
        _TARGET["t"] = llama_target(TINY, 8)
    return _TARGET["t"]


def _eagle3_heads(target, layers=(2, 4, 5), seed=0, **kwargs):
    config = HeadsConfig.for_target(
        target.config,
        head_kind="eagle",
        eagle_layout="eagle3",
        feature_layers=list(layers),
        draft_vocab_size=kwargs.pop("draft_vocab_size", VD),
        eagle_fc_bias=False,
        **kwargs,
    )
    heads = build_heads(config).attach(target)
    heads.init_projection_from_target()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return heads


# ---------------------------------------------------------------- (a) the borrowed embedding is written


def speculators_draft_logits(tensors, ids, g, pos):
    """The Eagle3 draft as speculators / vLLM build it from the file alone: its embedding is the file's
    embed_tokens.weight, or zeros when the file has none; logits over the draft vocabulary."""
    embedding = tensors.get("embed_tokens.weight", torch.zeros(V, H))
    return ref_eagle3(tensors, "layers.0.", F.embedding(ids, embedding.float()), g, pos)[1]


def test_vllm_export_carries_the_borrowed_embedding(tmp_path):
    target = _target()
    heads = _eagle3_heads(target)
    assert heads.embed_tokens is None  # the heads borrow the target's embedding
    out = export_heads(
        save_heads(heads, tmp_path / "ours"), tmp_path / "v", "vllm", "org/tiny", target=target
    )
    tensors = load_file(out / "model.safetensors")
    assert torch.equal(tensors["embed_tokens.weight"], target.get_input_embeddings().weight)
    gen = torch.Generator().manual_seed(3)
    ids, g = torch.randint(0, V, (1, 6), generator=gen), torch.randn(1, 6, H, generator=gen)
    with torch.no_grad():
        ours = heads.logits(heads(ids, g, position_ids=torch.arange(6)[None]))
    torch.testing.assert_close(speculators_draft_logits(tensors, ids, g, torch.arange(6)), ours)


def test_vllm_export_reads_the_embedding_from_the_target_folder(tmp_path):
    """From the CLI: the embedding comes from the folder the heads record (or --target)."""
    target = _target()
    folder = tmp_path / "target"
    target.save_pretrained(folder)
    config = HeadsConfig.for_target(
        AutoModelForCausalLM.from_pretrained(folder).config,
        head_kind="eagle",
        eagle_layout="eagle3",
        feature_layers=[2, 4, 5],
        draft_vocab_size=VD,
        eagle_fc_bias=False,
    )
    assert config.target_config["_name_or_path"] == str(folder)
    ours = save_heads(build_heads(config), tmp_path / "ours")
    assert cli.main(["export", "--to", "vllm", str(ours), str(tmp_path / "v"), "--verifier", "org/t"]) == 0
    tensors = load_file(tmp_path / "v" / "model.safetensors")
    assert torch.equal(tensors["embed_tokens.weight"], target.get_input_embeddings().weight)
    # the same from --target when the recorded folder is gone
    (tmp_path / "target").rename(tmp_path / "moved")
    args = ["export", "--to", "vllm", str(ours), str(tmp_path / "v2"), "--verifier", "org/t"]
    assert cli.main(args) == 2
    assert cli.main([*args, "--target", str(tmp_path / "moved")]) == 0
    assert torch.equal(
        load_file(tmp_path / "v2" / "model.safetensors")["embed_tokens.weight"],
        tensors["embed_tokens.weight"],
    )


# ---------------------------------------------------------------- (b) SGLang serves norm_output


def test_sglang_export_of_norm_output_heads(tmp_path):
    target = _target()
    layer = {"norm_output": True}
    from selfdraft.heads.eagle3.module import layer_config_from_target

    heads = _eagle3_heads(
        target, eagle_layer_config={**layer_config_from_target(target.config.to_dict()), **layer}
    )
    out = export_heads(save_heads(heads, tmp_path / "ours"), tmp_path / "sg", "sglang")
    config = json.loads((out / "config.json").read_text())
    assert config["norm_output"] is True  # SGLang: getattr(config, "norm_output", False)
    tensors = load_file(out / "model.safetensors")
    gen = torch.Generator().manual_seed(4)
    ids, g, pos = (
        torch.randint(0, V, (1, 5), generator=gen),
        torch.randn(1, 5, H, generator=gen),
        torch.arange(5),
    )
    emb = F.embedding(ids, target.get_input_embeddings().weight)
    fed_back, logits = ref_eagle3(tensors, "midlayer.", emb, g, pos, norm_output=True)
    with torch.no_grad():
        got = heads(ids, g, position_ids=pos[None])
        torch.testing.assert_close(got, fed_back)
        torch.testing.assert_close(heads.logits(got), logits)


# ---------------------------------------------------------------- (c) layer 0 (the embeddings) is captured


def vllm_captured(hidden_states, ids):
    """vLLM: aux hidden state k is the input of target layer ids[k] (transformers hidden_states[i])."""
    return [hidden_states[i] for i in ids]


def sglang_captured(hidden_states, ids):
    """SGLang: layers_to_capture = [id + 1]; layer j captures its input, hidden_states[j]."""
    return [hidden_states[i + 1] for i in ids]


def test_layer_zero_exports_as_the_engines_capture_it(tmp_path):
    target = _target()
    heads = _eagle3_heads(target, layers=(0, 3, 6))
    ours = save_heads(heads, tmp_path / "ours")
    vllm = json.loads(
        (export_heads(ours, tmp_path / "v", "vllm", "org/t", target=target) / "config.json").read_text()
    )
    sglang = json.loads((export_heads(ours, tmp_path / "s", "sglang") / "config.json").read_text())
    ids = torch.tensor([[5, 7, 11, 2]])
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states
        want = heads.fuse_features(hidden)
        for captured in (
            vllm_captured(hidden, vllm["eagle_aux_hidden_state_layer_ids"]),
            sglang_captured(hidden, sglang["eagle_config"]["eagle_aux_hidden_state_layer_ids"]),
        ):
            assert torch.equal(heads.fc(torch.cat(captured, -1)), want)
    assert vllm["eagle_aux_hidden_state_layer_ids"] == [0, 3, 6]
    # the final-norm output (index L) is no layer's input: still refused
    with pytest.raises(ExportError, match="final-norm output"):
        export_heads(
            save_heads(_eagle3_heads(target, layers=(2, 4, 8)), tmp_path / "o2"), tmp_path / "x", "sglang"
        )


# ---------------------------------------------------------------- (d) the verifier is a hub id


def _config_recording(name_or_path):
    target = _target()
    config = HeadsConfig.for_target(
        target.config,
        head_kind="eagle",
        eagle_layout="eagle3",
        feature_layers=[2, 4, 5],
        draft_vocab_size=VD,
        eagle_fc_bias=False,
    )
    config.target_config["_name_or_path"] = name_or_path
    return config


@pytest.mark.parametrize(
    "recorded",
    [
        "/root/.cache/selfdraft/smollm2-135m-instruct",
        "/home/u/.cache/selfdraft/smollm2-135m-instruct",
        "smollm2-135m-instruct",
    ],
)
def test_embedded_target_exports_its_hub_id(recorded):
    verifier = engine_config(_config_recording(recorded), "vllm", torch.float32)["speculators_config"][
        "verifier"
    ]
    assert verifier == {
        "name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "architectures": ["LlamaForCausalLM"],
    }
    assert EMBEDDED["smollm2-135m-instruct"].hub_id == verifier["name_or_path"]


def test_local_folder_target_is_refused_without_verifier(tmp_path):
    folder = tmp_path / "my-llama"
    folder.mkdir()
    for recorded in (str(folder), "/data/models/my-llama"):
        with pytest.raises(ExportError) as err:
            engine_config(_config_recording(recorded), "vllm", torch.float32)
        text = str(err.value)
        assert "\n" not in text and "--verifier" in text and recorded in text
    # a local folder that a selfdraft conversion wrote (its SOURCE file) is the embedded target
    (folder / "SOURCE").write_text("smollm2-135m-instruct\nsha256 x\n")
    spec = engine_config(_config_recording(str(folder)), "vllm", torch.float32)["speculators_config"]
    assert spec["verifier"]["name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    # a hub id recorded as such, or --verifier, is written as given
    assert (
        engine_config(_config_recording("org/model"), "vllm", torch.float32)["speculators_config"][
            "verifier"
        ]["name_or_path"]
        == "org/model"
    )
    given = engine_config(_config_recording(str(folder)), "vllm", torch.float32, "org/other")
    assert given["speculators_config"]["verifier"]["name_or_path"] == "org/other"


def test_export_prints_the_vllm_method(tmp_path, capsys):
    target = _target()
    ours = save_heads(_eagle3_heads(target), tmp_path / "ours")
    folder = tmp_path / "t"
    target.save_pretrained(folder)
    argv = [
        "export",
        "--to",
        "vllm",
        str(ours),
        str(tmp_path / "v"),
        "--verifier",
        "org/t",
        "--target",
        str(folder),
    ]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert '"method": "eagle3"' in out and '"eagle"' in out


# ---------------------------------------------------------------- item 4: heads of a Qwen2 target (qkv biases)


def _qwen2_target():
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=V,
        hidden_size=H,
        intermediate_size=64,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
    )
    return prepare_target(AutoModelForCausalLM.from_config(config, attn_implementation="sdpa"))


def vllm_eagle3_parameters(llama: dict, draft_vocab: int, target_hidden: int) -> dict[str, tuple]:
    """The parameters vLLM's Eagle3LlamaForCausalLM builds for a one-layer draft config (shapes as the
    checkpoint holds them, q/k/v and gate/up before stacking), with a bias wherever its config makes
    one: qkv (attention_bias / bias / qkv_bias), o_proj (attention_bias / bias), MLP (mlp_bias)."""
    h, i = llama["hidden_size"], llama["intermediate_size"]
    hd, nh, nkv = llama["head_dim"], llama["num_attention_heads"], llama["num_key_value_heads"]
    attention_bias = bool(llama.get("attention_bias") or llama.get("bias"))
    qkv_bias = bool(llama.get("qkv_bias", attention_bias))
    p = "layers.0."
    shapes = {
        "embed_tokens.weight": (llama["vocab_size"], h),
        "fc.weight": (h, 3 * target_hidden),
        "norm.weight": (h,),
        "lm_head.weight": (draft_vocab, h),
        "d2t": (draft_vocab,),
        p + "self_attn.q_proj.weight": (nh * hd, 2 * h),
        p + "self_attn.k_proj.weight": (nkv * hd, 2 * h),
        p + "self_attn.v_proj.weight": (nkv * hd, 2 * h),
        p + "self_attn.o_proj.weight": (h, nh * hd),
        p + "mlp.gate_proj.weight": (i, h),
        p + "mlp.up_proj.weight": (i, h),
        p + "mlp.down_proj.weight": (h, i),
        p + "input_layernorm.weight": (h,),
        p + "hidden_norm.weight": (h,),
        p + "post_attention_layernorm.weight": (h,),
    }
    if qkv_bias:
        shapes.update(
            {p + f"self_attn.{x}_proj.bias": (n * hd,) for x, n in (("q", nh), ("k", nkv), ("v", nkv))}
        )
    if attention_bias:
        shapes[p + "self_attn.o_proj.bias"] = (h,)
    if llama.get("mlp_bias"):
        shapes.update({p + f"mlp.{x}_proj.bias": (n,) for x, n in (("gate", i), ("up", i), ("down", h))})
    return shapes


def test_qwen2_target_heads_export_as_llama_layer_drafts(tmp_path):
    target = _qwen2_target()
    assert target.model.layers[0].self_attn.q_proj.bias is not None  # Qwen2 has qkv biases
    heads = _eagle3_heads(target)
    ours = save_heads(heads, tmp_path / "ours")
    out = export_heads(ours, tmp_path / "v", "vllm", "Qwen/Qwen2.5-0.5B", target=target)
    vllm = json.loads((out / "config.json").read_text())
    llama = vllm["transformer_layer_config"]
    assert llama["model_type"] == "llama" and llama["rope_theta"] == 1000000.0
    assert vllm["speculators_config"]["verifier"]["architectures"] == ["Qwen2ForCausalLM"]
    tensors = load_file(out / "model.safetensors")
    want = vllm_eagle3_parameters(llama, vllm["draft_vocab_size"], vllm["target_hidden_size"])
    got = {k: tuple(v.shape) for k, v in tensors.items() if k != "t2d"}  # vLLM skips t2d
    assert got == want
    # SGLang: the same layer under midlayer., no embedding (its worker sets the target's), bias false
    sg_out = export_heads(ours, tmp_path / "s", "sglang")
    sg = json.loads((sg_out / "config.json").read_text())
    assert sg["bias"] is False and not sg["attention_bias"] and not sg.get("qkv_bias")
    sg_shapes = {
        k.replace("midlayer.", "layers.0."): tuple(v.shape)
        for k, v in load_file(sg_out / "model.safetensors").items()
    }
    assert sg_shapes == {k: v for k, v in {**want, "t2d": (V,)}.items() if k != "embed_tokens.weight"}
    # and they load back onto the Qwen2 target computing exactly what was exported
    for folder in (out, sg_out):
        back = load_heads(folder, target)
        for (n1, a), (n2, b) in zip(heads.state_dict().items(), back.state_dict().items(), strict=True):
            assert n1 == n2 and torch.equal(a, b)
