"""Interop checked against the engines' own loaders (vLLM, SGLang, vLLM speculators).

Every checkpoint here is written the way the engine's (or speculators') source defines the format:
tensor names, config keys and their defaults, never with selfdraft's exporter. The sources followed:
    vLLM   vllm/transformers_utils/configs/speculators/algos.py `update_eagle3` (a speculators config
           without norm_before_residual means True; norm_output passed on) and
           vllm/model_executor/models/llama_eagle3.py (norm_output: the post-norm state is fed back)
    SGLang python/sglang/srt/models/llama_eagle3.py + llama.py (config `bias` is the fc bias and the
           decoder layer's attention bias; `set_embed` swaps in the target's embedding unless the widths
           differ)
    speculators  src/speculators/models/eagle3/config.py (Eagle3SpeculatorConfig fields),
           convert/eagle/eagle3_converter.py (embed_tokens.weight kept when the drafter has one;
           max_position_embeddings = max(draft, target)), and its former EAGLE-1 / HASS format
           (EagleSpeculatorConfig: fusion_fc.*, transformer.*, layernorms, fusion_bias)
"""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from test_interop import EPS, TINY, attention, llama_target, mlp, ref_eagle1, rms

from selfdraft.heads import HeadsConfig, build_heads, load_heads, save_heads
from selfdraft.heads.convert import UnknownLayoutError, convert_heads
from selfdraft.heads.eagle3.export import ExportError, engine_config, export_heads
from selfdraft.heads.eagle3.module import layer_config_from_target
from selfdraft.heads.published import UnsupportedVariantError
from selfdraft.inference import SelfDraftModel
from selfdraft.kv import new_cache

from tiny_models import greedy_reference, tiny_target

H, V, VD = TINY["hidden"], TINY["vocab"], TINY["draft_vocab"]
AUX = [1, 4, 6]  # speculators / vLLM ids: the INPUT of target layer i (our hidden_states index)
_TARGETS = {}


def eagle3_target():
    if "eagle3" not in _TARGETS:
        _TARGETS["eagle3"] = llama_target(TINY, 8)
    return _TARGETS["eagle3"]


def eagle1_target():
    if "eagle1" not in _TARGETS:
        _TARGETS["eagle1"] = tiny_target("llama")
    return _TARGETS["eagle1"]


def _w(gen, out, inp):
    return torch.randn(out, inp, generator=gen) / inp**0.5


def _norm(gen, n):
    return 1 + 0.1 * torch.randn(n, generator=gen)


def _decoder(prefix, gen, q_in, eagle3):
    """One Llama decoder layer's tensors (transformers names); EAGLE-3's q/k/v read 2h."""
    hd = H // TINY["heads"]
    t = {
        "self_attn.q_proj.weight": _w(gen, TINY["heads"] * hd, q_in),
        "self_attn.k_proj.weight": _w(gen, TINY["kv"] * hd, q_in),
        "self_attn.v_proj.weight": _w(gen, TINY["kv"] * hd, q_in),
        "self_attn.o_proj.weight": _w(gen, H, TINY["heads"] * hd),
        "mlp.gate_proj.weight": _w(gen, TINY["inter"], H),
        "mlp.up_proj.weight": _w(gen, TINY["inter"], H),
        "mlp.down_proj.weight": _w(gen, H, TINY["inter"]),
        "post_attention_layernorm.weight": _norm(gen, H),
    }
    if eagle3:
        t["input_layernorm.weight"] = _norm(gen, H)
        t["hidden_norm.weight"] = _norm(gen, H)
    return {prefix + k: v for k, v in t.items()}


def _layer_config(**extra):
    """A LlamaConfig dict as speculators serialises transformer_layer_config."""
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": H,
        "intermediate_size": TINY["inter"],
        "num_attention_heads": TINY["heads"],
        "num_key_value_heads": TINY["kv"],
        "num_hidden_layers": 1,
        "rms_norm_eps": EPS,
        "rope_theta": TINY["theta"],
        "max_position_embeddings": 2048,
        "vocab_size": V,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        **extra,
    }


def _speculators_block(algorithm):
    return {
        "algorithm": algorithm,
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": "org/tiny-llama", "architectures": ["LlamaForCausalLM"]},
    }


def _write(path, tensors, config):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "model.safetensors"))
    return tensors


def _eagle3_tensors(gen, prefix):
    ids = torch.randperm(V, generator=gen)[:VD].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    t = {"fc.weight": _w(gen, H, 3 * H), "norm.weight": _norm(gen, H), "lm_head.weight": _w(gen, VD, H)}
    t.update(_decoder(prefix, gen, 2 * H, eagle3=True))
    t.update(d2t=ids - torch.arange(VD), t2d=t2d)
    return t


def write_speculators_eagle3(path, seed=0, embed=None, extra_tensors=None, **fields):
    """Eagle3SpeculatorConfig's config.json + Eagle3Speculator's tensors (layers.0.*). `fields` are the
    top-level config keys (norm_before_residual, norm_output, ...); one left out stays absent."""
    gen = torch.Generator().manual_seed(seed)
    t = _eagle3_tensors(gen, "layers.0.")
    if embed is not None:
        t["embed_tokens.weight"] = embed
    t.update(extra_tensors or {})
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_config": _speculators_block("eagle3"),
        "transformer_layer_config": _layer_config(),
        "draft_vocab_size": VD,
        "target_hidden_size": H,
        "eagle_aux_hidden_state_layer_ids": AUX,
        **fields,
    }
    return _write(path, t, config)


def write_sglang_eagle3(path, seed=0, **fields):
    """SGLang's LlamaForCausalLMEagle3 folder: a Llama config.json + midlayer.* tensors."""
    gen = torch.Generator().manual_seed(seed)
    t = _eagle3_tensors(gen, "midlayer.")
    config = {
        **_layer_config(architectures=["LlamaForCausalLMEagle3"]),
        "draft_vocab_size": VD,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": [i - 1 for i in AUX],
            "use_aux_hidden_state": True,
        },
        **fields,
    }
    return _write(path, t, config)


def write_eagle1(path, seed=0, embed=None):
    """SafeAILab EAGLE-1 (yuhuili/EAGLE-*): fc (2h -> h, bias), layers.0.* without input_layernorm,
    and the embed_tokens.weight those checkpoints carry."""
    gen = torch.Generator().manual_seed(seed)
    t = {"fc.weight": _w(gen, H, 2 * H), "fc.bias": 0.1 * torch.randn(H, generator=gen)}
    t.update(_decoder("layers.0.", gen, H, eagle3=False))
    if embed is not None:
        t["embed_tokens.weight"] = embed
    return _write(path, t, {**_layer_config(), "bias": True})


def write_speculators_eagle1(path, seed=0, layernorms=False):
    """speculators EAGLE-1 / HASS (EagleSpeculatorConfig): fusion_fc.* and transformer.* (its
    input_layernorm is an Identity unless layernorms); with layernorms, the HASS extra norms."""
    gen = torch.Generator().manual_seed(seed)
    t = {"fusion_fc.weight": _w(gen, H, 2 * H), "fusion_fc.bias": 0.1 * torch.randn(H, generator=gen)}
    t.update(_decoder("transformer.", gen, H, eagle3=False))
    if layernorms:
        t["embedding_layernorm.weight"] = _norm(gen, H)
        t["transformer.input_layernorm.weight"] = _norm(gen, H)
        t["pre_lm_head_layernorm.weight"] = _norm(gen, H)
    config = {
        "architectures": ["EagleSpeculator", "LlamaDecoderLayer"],
        "speculators_model_type": "eagle",
        "transformer_layer_architecture": "LlamaDecoderLayer",
        "transformer_layer_config": _layer_config(),
        "layernorms": layernorms,
        "fusion_bias": True,
        "speculators_config": _speculators_block("eagle"),
    }
    return _write(path, t, config)


# ---------------------------------------------------------------- the engines' forwards, in plain torch


def ref_eagle3(t, p, emb, g, pos, norm_before_residual=False, norm_output=False):
    """vLLM llama_eagle3.py: attention over cat(input_layernorm(emb), hidden_norm(g)); the residual is g,
    or hidden_norm(g) with norm_before_residual; logits = lm_head(norm(out)). Returns (the state fed
    back: norm(out) with norm_output, else out; logits)."""
    hidden = rms(g, t[p + "hidden_norm.weight"])
    x = torch.cat([rms(emb, t[p + "input_layernorm.weight"]), hidden], -1)
    h = (hidden if norm_before_residual else g) + attention(x, t, p, TINY, pos)
    out = h + mlp(rms(h, t[p + "post_attention_layernorm.weight"]), t, p)
    normed = rms(out, t["norm.weight"])
    return (normed if norm_output else out), normed @ t["lm_head.weight"].T


def _inputs(n=7, seed=1):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (1, n), generator=gen)
    return ids, torch.randn(1, n, H, generator=gen), torch.arange(n)


def check_eagle3(heads, tensors, prefix, emb_weight, **variant):
    ids, feats, pos = _inputs()
    want, want_logits = ref_eagle3(tensors, prefix, F.embedding(ids, emb_weight), feats, pos, **variant)
    with torch.no_grad():
        got = heads(ids, feats, position_ids=pos[None])
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(heads.logits(got), want_logits)
        cache = new_cache()  # incrementally, through a KV cache: the same states
        first = heads(ids[:, :4], feats[:, :4], position_ids=pos[None, :4], cache=cache)
        second = heads(ids[:, 4:], feats[:, 4:], position_ids=pos[None, 4:], cache=cache)
        torch.testing.assert_close(torch.cat([first, second], 1), want)


def _eagle3_heads_config(target, **kwargs):
    return HeadsConfig.for_target(
        target.config,
        head_kind="eagle",
        eagle_layout="eagle3",
        feature_layers=[2, 4, 5],
        draft_vocab_size=VD,
        **kwargs,
    )


def _one_line(err):
    text = str(err.value)
    assert "\n" not in text
    return text


# ---------------------------------------------------------------- norm_before_residual / norm_output


@pytest.mark.parametrize(
    "fields,expected",
    [({"norm_before_residual": True}, True), ({"norm_before_residual": False}, False), ({}, True)],
    ids=["true", "false", "absent"],
)
def test_speculators_norm_before_residual_reads_as_vllm_does(tmp_path, fields, expected):
    target = eagle3_target()
    tensors = write_speculators_eagle3(tmp_path, **fields)
    heads = load_heads(tmp_path, target)
    assert heads.config.eagle_layer_config["norm_before_residual"] is expected
    check_eagle3(
        heads, tensors, "layers.0.", target.get_input_embeddings().weight, norm_before_residual=expected
    )


def test_sglang_config_without_norm_before_residual_is_false(tmp_path):
    """Not a speculators config: vLLM's llama_eagle3.py reads getattr(config, ..., False); SGLang has none."""
    target = eagle3_target()
    tensors = write_sglang_eagle3(tmp_path)
    heads = load_heads(tmp_path, target)
    assert heads.config.eagle_layer_config["norm_before_residual"] is False
    assert heads.config.feature_layers == AUX
    check_eagle3(heads, tensors, "midlayer.", target.get_input_embeddings().weight)


def test_norm_output_feeds_back_the_post_norm_state(tmp_path):
    target = eagle3_target()
    tensors = write_speculators_eagle3(tmp_path, norm_before_residual=True, norm_output=True)
    heads = load_heads(tmp_path, target)
    assert heads.config.eagle_layer_config["norm_output"] is True
    check_eagle3(
        heads,
        tensors,
        "layers.0.",
        target.get_input_embeddings().weight,
        norm_before_residual=True,
        norm_output=True,
    )
    # A second drafting step reads the post-norm state it fed back.
    ids, feats, pos = _inputs()
    emb = target.get_input_embeddings().weight
    with torch.no_grad():
        fed_back = heads(ids, feats, position_ids=pos[None])
        step2 = heads(ids, fed_back, position_ids=pos[None])
    want1, _ = ref_eagle3(tensors, "layers.0.", F.embedding(ids, emb), feats, pos, True, True)
    want2, _ = ref_eagle3(tensors, "layers.0.", F.embedding(ids, emb), want1, pos, True, True)
    torch.testing.assert_close(step2, want2)
    # Drafting stays lossless.
    prompt = torch.tensor([[4, 9, 33, 2, 71]])
    out = SelfDraftModel(target, None, heads, tree="small").generate(
        prompt, max_new_tokens=10, stop_token_ids=[]
    )
    assert out.tokens == greedy_reference(target, prompt, 10)


def test_norm_output_exports_for_vllm_and_sglang(tmp_path):
    target = eagle3_target()
    tensors = write_speculators_eagle3(tmp_path / "src", norm_before_residual=False, norm_output=True)
    ours = convert_heads(tmp_path / "src", tmp_path / "ours", target)
    out = export_heads(ours, tmp_path / "vllm", "vllm", target=target)
    config = json.loads((out / "config.json").read_text())
    assert config["norm_output"] is True and config["norm_before_residual"] is False
    back = load_heads(out, target)
    assert back.config.eagle_layer_config["norm_output"] is True
    # SGLang 0.5.23 llama_eagle3.py: LlamaModel reads config `norm_output` and feeds back the normed state
    out = export_heads(ours, tmp_path / "sglang", "sglang")
    config = json.loads((out / "config.json").read_text())
    assert config["norm_output"] is True and "norm_before_residual" not in config
    back = load_heads(out, target)
    assert back.config.eagle_layer_config["norm_output"] is True
    tensors = {k.replace("layers.0.", "midlayer."): v for k, v in tensors.items()}
    check_eagle3(back, tensors, "midlayer.", target.get_input_embeddings().weight, norm_output=True)


@pytest.mark.parametrize(
    "flag,tensors",
    [
        ("norm_before_fc", {"input_norm.weight": 3 * H}),
        ("fc_norm", {"fc_norm.0.weight": H, "fc_norm.1.weight": H, "fc_norm.2.weight": H}),
    ],
)
def test_fused_layer_norms_are_refused_not_ignored(tmp_path, flag, tensors):
    extra = {name: torch.ones(n) for name, n in tensors.items()}
    write_speculators_eagle3(tmp_path, extra_tensors=extra, **{flag: True})
    with pytest.raises(UnsupportedVariantError) as err:
        load_heads(tmp_path, eagle3_target())
    assert f"`{flag}`" in _one_line(err)


# ---------------------------------------------------------------- embeddings inside the files


@pytest.mark.parametrize("same", [True, False], ids=["targets-copy", "own"])
def test_eagle1_file_with_an_embedding(tmp_path, same):
    target = eagle1_target()
    mine = target.get_input_embeddings().weight.detach().clone()
    embed = mine if same else torch.randn(V, H, generator=torch.Generator().manual_seed(5))
    tensors = write_eagle1(tmp_path, embed=embed)
    heads = load_heads(tmp_path, target)
    assert heads.config.eagle_own_embedding is (not same)
    assert ("embed_tokens.weight" in heads.state_dict()) is (not same)
    ids, feats, pos = _inputs()
    with torch.no_grad():
        got = heads(ids, feats, position_ids=pos[None])
    torch.testing.assert_close(got, ref_eagle1(tensors, TINY, F.embedding(ids, embed), feats, pos))


@pytest.mark.parametrize("same", [True, False], ids=["targets-copy", "own"])
def test_speculators_file_with_an_embedding(tmp_path, same):
    """speculators' Eagle3Converter keeps embed_tokens.weight when the drafter has one."""
    target = eagle3_target()
    mine = target.get_input_embeddings().weight.detach().clone()
    embed = mine if same else torch.randn(V, H, generator=torch.Generator().manual_seed(6))
    tensors = write_speculators_eagle3(tmp_path / "src", embed=embed, norm_before_residual=False)
    heads = load_heads(tmp_path / "src", target)
    assert heads.config.eagle_own_embedding is (not same)
    check_eagle3(heads, tensors, "layers.0.", embed)
    ours = convert_heads(tmp_path / "src", tmp_path / "ours", target)
    vllm = load_file(export_heads(ours, tmp_path / "vllm", "vllm", target=target) / "model.safetensors")
    assert torch.equal(vllm["embed_tokens.weight"], embed)  # the target's copy, or the head's own
    if same:  # the target's own embedding: SGLang's eagle worker hands the target's to the draft
        assert "embed_tokens.weight" not in load_file(
            export_heads(ours, tmp_path / "sg", "sglang") / "model.safetensors"
        )
    else:
        with pytest.raises(ExportError) as err:
            export_heads(ours, tmp_path / "sg", "sglang")
        text = _one_line(err)
        assert "eagle_own_embedding" in text and "replaces" in text and "--to vllm" in text


def test_sglang_keeps_an_own_embedding_of_another_width(tmp_path):
    """SGLang's set_embed leaves the draft's embedding alone when hidden_size != target_hidden_size."""
    target = eagle3_target()
    layer = {**layer_config_from_target(target.config.to_dict()), "hidden_size": 16, "intermediate_size": 32}
    layer.update(num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    config = _eagle3_heads_config(
        target, eagle_fc_bias=False, eagle_own_embedding=True, eagle_layer_config=layer
    )
    heads = build_heads(config)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.2)
    out = export_heads(save_heads(heads, tmp_path / "ours"), tmp_path / "sg", "sglang")
    sg = json.loads((out / "config.json").read_text())
    assert sg["hidden_size"] == 16 and sg["target_hidden_size"] == H and sg["bias"] is False
    assert load_file(out / "model.safetensors")["embed_tokens.weight"].shape == (V, 16)
    back = load_heads(out, target)
    for (n1, a), (n2, b) in zip(heads.state_dict().items(), back.state_dict().items(), strict=True):
        assert n1 == n2 and torch.equal(a, b)


# ---------------------------------------------------------------- fc bias and max_position_embeddings on export


def test_default_fc_bias_is_refused_for_both_engines(tmp_path):
    target = eagle3_target()
    config = _eagle3_heads_config(target)  # HeadsConfig's default eagle_fc_bias=True
    assert config.eagle_fc_bias is True
    ours = save_heads(build_heads(config), tmp_path / "ours")
    for engine in ("sglang", "vllm"):
        with pytest.raises(ExportError) as err:
            export_heads(ours, tmp_path / engine, engine, verifier_name_or_path="org/tiny")
        text = _one_line(err)
        assert "eagle_fc_bias" in text and "eagle_fc_bias=False" in text, text
    with pytest.raises(ExportError, match="o_proj"):
        export_heads(ours, tmp_path / "sg", "sglang")
    assert not (tmp_path / "sg").exists()  # nothing half-written


def test_export_writes_the_larger_max_position_embeddings(tmp_path):
    target = eagle3_target()
    assert target.config.max_position_embeddings == 256
    layer = {**layer_config_from_target(target.config.to_dict()), "max_position_embeddings": 64}
    config = _eagle3_heads_config(target, eagle_fc_bias=False, eagle_layer_config=layer)
    for engine in ("vllm", "sglang"):
        written = engine_config(config, engine, torch.float32, "org/tiny")
        llama = written.get("transformer_layer_config", written)
        assert llama["max_position_embeddings"] == 256
    longer = _eagle3_heads_config(
        target, eagle_fc_bias=False, eagle_layer_config={**layer, "max_position_embeddings": 4096}
    )
    assert engine_config(longer, "sglang", torch.float32)["max_position_embeddings"] == 4096
    # YaRN's rotations depend on max_position_embeddings: the head's own value is kept.
    scaling = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32}
    yarn = {**layer, "rope": {"rope_theta": 10000.0, "rope_scaling": scaling}}
    yarn_config = _eagle3_heads_config(target, eagle_fc_bias=False, eagle_layer_config=yarn)
    assert engine_config(yarn_config, "sglang", torch.float32)["max_position_embeddings"] == 64


# ---------------------------------------------------------------- speculators EAGLE-1 / HASS


def test_speculators_eagle1_layout_loads(tmp_path):
    target = eagle1_target()
    written = write_speculators_eagle1(tmp_path / "src")
    heads = load_heads(tmp_path / "src", target)
    assert heads.config.eagle_layout == "eagle1" and heads.config.eagle_fc_bias is True
    assert heads.config.converted_from["layout"] == "speculators-eagle1"
    assert heads.config.eagle_layer_config["input_layernorm"] is False
    renamed = {
        k.replace("fusion_fc.", "fc.").replace("transformer.", "layers.0."): v for k, v in written.items()
    }
    ids, feats, pos = _inputs()
    emb = target.get_input_embeddings()(ids)
    with torch.no_grad():
        got = heads(ids, feats, position_ids=pos[None])
        torch.testing.assert_close(got, ref_eagle1(renamed, TINY, emb, feats, pos))
        torch.testing.assert_close(heads.logits(got), target.get_output_embeddings()(got))
    ours = convert_heads(tmp_path / "src", tmp_path / "ours", target)
    assert load_heads(ours, target).config.eagle_layout == "eagle1"


def test_speculators_hass_layernorms_variant_is_named_in_the_error(tmp_path):
    write_speculators_eagle1(tmp_path, layernorms=True)
    with pytest.raises(UnsupportedVariantError) as err:
        load_heads(tmp_path, eagle1_target())
    text = _one_line(err)
    assert "layernorms: true" in text and "embedding_layernorm.weight" in text


def test_unknown_layout_message_names_the_speculators_eagle1_layout(tmp_path):
    _write(tmp_path, {"encoder.proj.weight": torch.zeros(2, 2)}, {"model_type": "bert"})
    with pytest.raises(UnknownLayoutError) as err:
        load_heads(tmp_path)
    assert "speculators EAGLE-1" in str(err.value) and "fusion_fc" in str(err.value)


def test_export_refuses_fused_layers_out_of_layer_order(tmp_path):
    """The engines concatenate captured layers in layer order; an fc trained on another order would
    silently read the wrong features, so such heads are refused."""
    from transformers import LlamaConfig

    from selfdraft.heads import HeadsConfig, build_heads, save_heads
    from selfdraft.heads.eagle3.export import ExportError, export_heads

    from tiny_models import COMMON

    six_layers = LlamaConfig(**{**COMMON, "num_hidden_layers": 6})
    config = HeadsConfig.for_target(
        six_layers, head_kind="eagle", eagle_layout="eagle3", draft_vocab_size=32, feature_layers=[3, 1, 4]
    )
    config.eagle_fc_bias = False
    save_heads(build_heads(config), tmp_path / "heads")
    with pytest.raises(ExportError, match="layer order"):
        export_heads(tmp_path / "heads", tmp_path / "out", "vllm", None, None)
