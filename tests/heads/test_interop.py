"""Interop with published heads: Medusa-1, EAGLE-1, EAGLE-3 (reference, SGLang, vLLM speculators).

Each layout is written synthetically, exactly as those projects lay it out, then loaded and converted.
The loaded module must compute what a direct, plain-torch re-implementation of the published forward
computes on the same tensors, decode token-identically to the target's greedy, and export -> import
must reproduce every tensor bit for bit.
"""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from selfdraft.heads import HeadsConfig, build_heads, load_heads, save_heads
from selfdraft.heads.convert import UnknownLayoutError, convert_heads
from selfdraft.heads.eagle3.export import ExportError, export_heads
from selfdraft.heads.folder import CorruptCheckpointError, HeadsMismatchError
from selfdraft.inference import SelfDraftModel
from selfdraft.kv import new_cache
from selfdraft.scripts import cli
from selfdraft.target import prepare_target

from tiny_models import greedy_reference, tiny_target

TINY = {"hidden": 32, "inter": 64, "heads": 4, "kv": 2, "vocab": 96, "theta": 10000.0, "draft_vocab": 40}
SMOL = {
    "hidden": 576,
    "inter": 1536,
    "heads": 9,
    "kv": 3,
    "vocab": 49152,
    "theta": 100000.0,
    "draft_vocab": 8192,
}
EPS = 1e-6
# Fused target layers as transformers hidden_states indices (input of layer i), per EAGLE-3 variant,
# for an 8-layer target: the reference default {2, L//2, L-3}; SGLang ids name layer OUTPUTS (+1).
EAGLE3_LAYERS = {"original": [2, 4, 5], "sglang": [2, 4, 7], "speculators": [1, 4, 6]}
SGLANG_IDS = [1, 3, 6]


# ---------------------------------------------------------------- synthetic published checkpoints


def _w(gen, out, inp):
    return torch.randn(out, inp, generator=gen) / inp**0.5


def _norm(gen, n):
    return 1 + 0.1 * torch.randn(n, generator=gen)


def _layer(prefix, d, gen, q_in, eagle3):
    h, nh, nkv, hd = d["hidden"], d["heads"], d["kv"], d["hidden"] // d["heads"]
    t = {
        "self_attn.q_proj.weight": _w(gen, nh * hd, q_in),
        "self_attn.k_proj.weight": _w(gen, nkv * hd, q_in),
        "self_attn.v_proj.weight": _w(gen, nkv * hd, q_in),
        "self_attn.o_proj.weight": _w(gen, h, nh * hd),
        "mlp.gate_proj.weight": _w(gen, d["inter"], h),
        "mlp.up_proj.weight": _w(gen, d["inter"], h),
        "mlp.down_proj.weight": _w(gen, h, d["inter"]),
        "post_attention_layernorm.weight": _norm(gen, h),
    }
    if eagle3:
        t["input_layernorm.weight"] = _norm(gen, h)
        t["hidden_norm.weight"] = _norm(gen, h)
    return {prefix + k: v for k, v in t.items()}


def _llama_json(d, **extra):
    return {
        "model_type": "llama",
        "hidden_size": d["hidden"],
        "intermediate_size": d["inter"],
        "num_attention_heads": d["heads"],
        "num_key_value_heads": d["kv"],
        "num_hidden_layers": 1,
        "rms_norm_eps": EPS,
        "rope_theta": d["theta"],
        "max_position_embeddings": 2048,
        "vocab_size": d["vocab"],
        "hidden_act": "silu",
        "torch_dtype": "float32",
        **extra,
    }


def _save(path, tensors, config, weights):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if weights.endswith(".safetensors"):
        save_file(tensors, str(path / weights))
    else:
        torch.save(tensors, path / weights)
    return tensors


def write_medusa(path, d, fmt="safetensors", num_heads=4, num_layers=1, stated_heads=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h, t = d["hidden"], {}
    for i in range(num_heads):
        for j in range(num_layers):
            t[f"{i}.{j}.linear.weight"] = _w(gen, h, h)
            t[f"{i}.{j}.linear.bias"] = 0.1 * torch.randn(h, generator=gen)
        t[f"{i}.{num_layers}.weight"] = _w(gen, d["vocab"], h)
    config = {
        "medusa_num_heads": stated_heads,
        "medusa_num_layers": num_layers,
        "base_model_name_or_path": "x",
    }
    return _save(path, t, config, f"medusa_lm_head.{fmt}")


def write_eagle1(path, d, fmt="safetensors", seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = d["hidden"]
    t = {"fc.weight": _w(gen, h, 2 * h), "fc.bias": 0.1 * torch.randn(h, generator=gen)}
    t.update(_layer("layers.0.", d, gen, h, eagle3=False))
    weights = "model.safetensors" if fmt == "safetensors" else "pytorch_model.bin"
    return _save(path, t, _llama_json(d, architectures=["LlamaForCausalLM"], bias=True), weights)


def write_eagle3(path, d, variant, dtype=torch.float32, aux=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h, vd, v = d["hidden"], d["draft_vocab"], d["vocab"]
    prefix = "layers.0." if variant == "speculators" else "midlayer."
    ids = torch.randperm(v, generator=gen)[:vd].sort().values  # the draft vocabulary's target ids
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[ids] = True
    t = {"fc.weight": _w(gen, h, 3 * h), "norm.weight": _norm(gen, h), "lm_head.weight": _w(gen, vd, h)}
    t.update(_layer(prefix, d, gen, 2 * h, eagle3=True))
    t = {k: x.to(dtype) for k, x in t.items()}
    t.update(d2t=ids - torch.arange(vd), t2d=t2d)
    llama = _llama_json(d, draft_vocab_size=vd, tie_word_embeddings=False)
    if variant == "original":
        return _save(path, t, {**llama, "architectures": ["LlamaForCausalLM"]}, "pytorch_model.bin")
    if variant == "sglang":
        eagle = {"eagle_aux_hidden_state_layer_ids": aux or SGLANG_IDS, "use_aux_hidden_state": True}
        config = {**llama, "architectures": ["LlamaForCausalLMEagle3"], "eagle_config": eagle}
        return _save(path, t, config, "model.safetensors")
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": "tiny-llama", "architectures": ["LlamaForCausalLM"]},
        },
        "transformer_layer_config": llama,
        "draft_vocab_size": vd,
        "target_hidden_size": h,
        "norm_before_residual": False,
        "eagle_aux_hidden_state_layer_ids": aux or EAGLE3_LAYERS["speculators"],
    }
    return _save(path, t, config, "model.safetensors")


def llama_target(d, layers, seed=0):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=d["vocab"],
        hidden_size=d["hidden"],
        intermediate_size=d["inter"],
        num_hidden_layers=layers,
        num_attention_heads=d["heads"],
        num_key_value_heads=d["kv"],
        max_position_embeddings=256,
        rope_theta=d["theta"],
        rms_norm_eps=EPS,
        tie_word_embeddings=d is SMOL,
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3 if d is TINY else 1.5 / d["hidden"] ** 0.5)
    return prepare_target(model)


# ---------------------------------------------------------------- the published forwards, in plain torch


def rms(x, w):
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


def rope(x, pos, theta):
    """x: [B, heads, T, d]; pos: [T]; the Llama rotation (rotate_half convention)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angle = pos.float()[:, None] * inv[None]
    cos, sin = torch.cat([angle, angle], -1).cos(), torch.cat([angle, angle], -1).sin()
    return x * cos + torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1) * sin


def attention(x, t, p, d, pos):
    b, n, _ = x.shape
    nh, nkv, hd = d["heads"], d["kv"], d["hidden"] // d["heads"]
    q = (x @ t[p + "self_attn.q_proj.weight"].T).view(b, n, nh, hd).transpose(1, 2)
    k = (x @ t[p + "self_attn.k_proj.weight"].T).view(b, n, nkv, hd).transpose(1, 2)
    v = (x @ t[p + "self_attn.v_proj.weight"].T).view(b, n, nkv, hd).transpose(1, 2)
    q, k = rope(q, pos, d["theta"]), rope(k, pos, d["theta"])
    k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
    scores = (q @ k.transpose(-1, -2)) / hd**0.5
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, nh * hd)
    return out @ t[p + "self_attn.o_proj.weight"].T


def mlp(x, t, p):
    gate, up = x @ t[p + "mlp.gate_proj.weight"].T, x @ t[p + "mlp.up_proj.weight"].T
    return (F.silu(gate) * up) @ t[p + "mlp.down_proj.weight"].T


def ref_eagle1(t, d, emb, f, pos):
    """EAGLE-1: x = fc(cat(emb, f)); one layer without input_layernorm; output goes to the lm_head."""
    x = torch.cat([emb, f], -1) @ t["fc.weight"].T + t["fc.bias"]
    x = x + attention(x, t, "layers.0.", d, pos)
    return x + mlp(rms(x, t["layers.0.post_attention_layernorm.weight"]), t, "layers.0.")


def ref_eagle3(t, p, d, emb, g, pos):
    """EAGLE-3: attention over cat(input_layernorm(emb), hidden_norm(g)), residual g; logits of norm."""
    x = torch.cat([rms(emb, t[p + "input_layernorm.weight"]), rms(g, t[p + "hidden_norm.weight"])], -1)
    h = g + attention(x, t, p, d, pos)
    out = h + mlp(rms(h, t[p + "post_attention_layernorm.weight"]), t, p)
    return out, rms(out, t["norm.weight"]) @ t["lm_head.weight"].T


def ref_medusa(t, num_heads, num_layers, hidden):
    logits = []
    for i in range(num_heads):
        x = hidden
        for j in range(num_layers):
            x = x + F.silu(x @ t[f"{i}.{j}.linear.weight"].T + t[f"{i}.{j}.linear.bias"])
        logits.append(x @ t[f"{i}.{num_layers}.weight"].T)
    return torch.stack(logits)


# ---------------------------------------------------------------- cases

CASES = {
    "medusa-safetensors": (TINY, lambda p, d: write_medusa(p, d, "safetensors")),
    "medusa-pt": (TINY, lambda p, d: write_medusa(p, d, "pt")),
    "eagle1-safetensors": (TINY, lambda p, d: write_eagle1(p, d, "safetensors")),
    "eagle1-bin": (TINY, lambda p, d: write_eagle1(p, d, "bin")),
    "eagle3-original": (TINY, lambda p, d: write_eagle3(p, d, "original")),
    "eagle3-sglang": (TINY, lambda p, d: write_eagle3(p, d, "sglang")),
    "eagle3-speculators": (TINY, lambda p, d: write_eagle3(p, d, "speculators")),
    "eagle3-speculators-smollm2": (SMOL, lambda p, d: write_eagle3(p, d, "speculators", aux=[1, 2, 3])),
    "eagle1-smollm2": (SMOL, lambda p, d: write_eagle1(p, d, "safetensors")),
}
_TARGETS = {}


def target_for(case):
    d = CASES[case][0]
    key = ("smol" if d is SMOL else "tiny", case.startswith("eagle3"))
    if key not in _TARGETS:
        if d is SMOL:
            _TARGETS[key] = llama_target(SMOL, 4)
        else:
            _TARGETS[key] = llama_target(TINY, 8) if key[1] else tiny_target("llama")
    return _TARGETS[key]


def _layers_of(case):
    return [1, 2, 3] if "smollm2" in case else EAGLE3_LAYERS[case.split("-")[1]]


def check_published_forward(case, heads, tensors, target):
    """The loaded module against the plain-torch published forward on the same tensors."""
    d = CASES[case][0]
    tol = {"rtol": 1e-4, "atol": 1e-4} if d is SMOL else {}
    gen = torch.Generator().manual_seed(1)
    n = 7
    ids = torch.randint(0, d["vocab"], (1, n), generator=gen)
    feats = torch.randn(1, n, d["hidden"], generator=gen)
    pos = torch.arange(n)
    emb = target.get_input_embeddings()(ids)
    with torch.no_grad():
        if case.startswith("medusa"):
            assert heads.num_heads == 4  # the tensors' count, not config.json's medusa_num_heads=2
            torch.testing.assert_close(
                heads.logits(feats[0, -1]), ref_medusa(tensors, 4, 1, feats[0, -1]), **tol
            )
            return
        got = heads(ids, feats, position_ids=pos[None])
        if case.startswith("eagle1"):
            want = ref_eagle1(tensors, d, emb, feats, pos)
            want_logits = target.get_output_embeddings()(want)
        else:
            p = "layers.0." if "speculators" in case else "midlayer."
            want, want_logits = ref_eagle3(tensors, p, d, emb, feats, pos)
            hidden_states = [torch.randn(1, n, d["hidden"], generator=gen) for _ in range(9)]
            fused = torch.cat([hidden_states[i] for i in _layers_of(case)], -1) @ tensors["fc.weight"].T
            torch.testing.assert_close(heads.fuse_features(hidden_states), fused, **tol)
            assert (
                heads.draft_vocab.to_target(torch.arange(d["draft_vocab"])).tolist()
                == (tensors["d2t"] + torch.arange(d["draft_vocab"])).tolist()
            )
        torch.testing.assert_close(got, want, **tol)
        torch.testing.assert_close(heads.logits(got), want_logits, **tol)
        # Incremental: a DynamicCache, a first chunk with the implicit causal mask, then an explicit 4D mask.
        cache = new_cache()
        first = heads(ids[:, :4], feats[:, :4], position_ids=pos[None, :4], cache=cache)
        mask = torch.zeros(1, 1, 3, n).masked_fill(
            ~torch.ones(3, n, dtype=torch.bool).tril(4), torch.finfo().min
        )
        second = heads(ids[:, 4:], feats[:, 4:], position_ids=pos[None, 4:], attention_mask=mask, cache=cache)
        torch.testing.assert_close(torch.cat([first, second], 1), want, **tol)


@pytest.mark.parametrize("case", list(CASES))
def test_published_layout_loads_and_computes_the_published_forward(tmp_path, case):
    d, write = CASES[case]
    target = target_for(case)
    tensors = write(tmp_path / "published", d)
    direct = load_heads(tmp_path / "published", target)  # the load path converts in memory
    check_published_forward(case, direct, tensors, target)
    ours = convert_heads(tmp_path / "published", tmp_path / "ours", target)
    assert sorted(p.name for p in ours.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((ours / "config.json").read_text())["model_type"] == "selfdraft_heads"
    converted = load_heads(ours, target)
    for (n1, a), (n2, b) in zip(direct.state_dict().items(), converted.state_dict().items(), strict=True):
        assert n1 == n2 and torch.equal(a, b)
    check_published_forward(case, converted, tensors, target)


@pytest.mark.parametrize("case", [c for c in CASES if "smollm2" not in c] + ["eagle1-smollm2"])
def test_greedy_generation_is_the_targets_greedy(tmp_path, case):
    d, write = CASES[case]
    target = target_for(case)
    write(tmp_path, d)
    small = d is TINY  # SmolLM2-sized vocab projections are slow on CPU: a short chain there
    model = SelfDraftModel(target, None, load_heads(tmp_path, target), tree="small" if small else "chain-3")
    prompt = torch.randint(0, d["vocab"], (1, 6), generator=torch.Generator().manual_seed(3))
    new_tokens = 16 if small else 6
    out = model.generate(prompt, max_new_tokens=new_tokens, stop_token_ids=[])
    assert out.tokens == greedy_reference(target, prompt, new_tokens)
    assert out.stats.tree_passes >= 1


def test_from_pretrained_accepts_a_published_folder(tmp_path, monkeypatch):
    target = target_for("eagle3-sglang")
    write_eagle3(tmp_path, TINY, "sglang")
    monkeypatch.setattr("selfdraft.inference.model.load_target", lambda *a, **k: (target, None))
    model = SelfDraftModel.from_pretrained("tiny", heads=tmp_path, tree="chain-4")
    assert model.heads.config.eagle_layout == "eagle3"
    prompt = torch.tensor([[5, 17, 3, 60]])
    assert model.generate(prompt, max_new_tokens=12, stop_token_ids=[]).tokens == greedy_reference(
        target, prompt, 12
    )


# ---------------------------------------------------------------- export


@pytest.mark.parametrize(
    "variant,dtype", [("original", torch.float32), ("sglang", torch.float32), ("speculators", torch.bfloat16)]
)
def test_export_import_round_trip_is_bit_exact(tmp_path, variant, dtype):
    target = target_for("eagle3-" + variant)
    published = write_eagle3(tmp_path / "published", TINY, variant, dtype=dtype)
    ours = convert_heads(tmp_path / "published", tmp_path / "ours", target)
    ours_state = load_file(ours / "model.safetensors")
    assert ours_state["fc.weight"].dtype == dtype  # precision kept
    for engine, prefix in (("vllm", "layers.0."), ("sglang", "midlayer.")):
        out = export_heads(ours, tmp_path / engine, engine, verifier_name_or_path="org/tiny-llama", target=target)
        exported = load_file(out / "model.safetensors")
        renamed = {
            k.replace("midlayer.", prefix).replace("layers.0.", prefix): v for k, v in published.items()
        }
        if engine == "vllm":  # speculators' format carries the embedding the heads borrow
            renamed["embed_tokens.weight"] = target.get_input_embeddings().weight.detach().to(dtype)
        assert sorted(exported) == sorted(renamed)
        for name, tensor in renamed.items():
            assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
        back = load_file(convert_heads(out, tmp_path / f"{engine}-back", target) / "model.safetensors")
        assert sorted(back) == sorted(ours_state)
        for name, tensor in ours_state.items():
            assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
        reloaded = load_heads(out, target)  # the engine folder also loads directly
        assert reloaded.config.feature_layers == EAGLE3_LAYERS[variant]


def test_exported_configs_follow_the_engine_layouts(tmp_path):
    target = target_for("eagle3-original")
    write_eagle3(tmp_path / "published", TINY, "original")
    ours = convert_heads(tmp_path / "published", tmp_path / "ours", target)
    exported = export_heads(ours, tmp_path / "v", "vllm", "org/tiny", target=target)
    vllm = json.loads((exported / "config.json").read_text())
    assert vllm["speculators_model_type"] == "eagle3" and vllm["architectures"] == ["Eagle3Speculator"]
    spec = vllm["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
    assert (
        spec["proposal_methods"][0]["proposal_type"] == "greedy"
        and spec["proposal_methods"][0]["speculative_tokens"]
    )
    assert spec["verifier"] == {"name_or_path": "org/tiny", "architectures": ["LlamaForCausalLM"]}
    layer = vllm["transformer_layer_config"]
    assert layer["num_hidden_layers"] == 1 and layer["hidden_size"] == 32 and layer["vocab_size"] == 96
    assert vllm["draft_vocab_size"] == 40 and vllm["target_hidden_size"] == 32
    assert vllm["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5] and vllm["norm_before_residual"] is False
    names = set(load_file(tmp_path / "v" / "model.safetensors"))
    assert {
        "fc.weight",
        "norm.weight",
        "lm_head.weight",
        "d2t",
        "t2d",
        "layers.0.hidden_norm.weight",
        "layers.0.self_attn.q_proj.weight",
        "layers.0.mlp.down_proj.weight",
    } <= names
    sglang = json.loads((export_heads(ours, tmp_path / "s", "sglang") / "config.json").read_text())
    assert sglang["architectures"] == ["LlamaForCausalLMEagle3"] and sglang["draft_vocab_size"] == 40
    assert sglang["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # layer outputs
    assert sglang["tie_word_embeddings"] is False and sglang["num_hidden_layers"] == 1
    assert all(
        n.startswith("midlayer.") or "." not in n or n.split(".")[0] in ("fc", "norm", "lm_head")
        for n in load_file(tmp_path / "s" / "model.safetensors")
    )


def test_export_refuses_heads_the_engines_cannot_serve(tmp_path):
    target = tiny_target("llama")
    medusa = build_heads(HeadsConfig.for_target(target.config, head_kind="medusa"))
    with pytest.raises(ExportError, match="Medusa"):
        export_heads(save_heads(medusa, tmp_path / "m"), tmp_path / "out", "vllm", "x")
    ours = build_heads(HeadsConfig.for_target(target.config, head_kind="eagle", eagle_layout="selfdraft"))
    with pytest.raises(ExportError, match="not the EAGLE-3 architecture"):
        export_heads(save_heads(ours, tmp_path / "e"), tmp_path / "out", "sglang")
    write_eagle1(tmp_path / "e1", TINY)
    with pytest.raises(ExportError, match="EAGLE-1"):
        export_heads(convert_heads(tmp_path / "e1", tmp_path / "e1-ours"), tmp_path / "out", "vllm", "x")


# ---------------------------------------------------------------- refusals and errors

PWNED = []


class Payload:
    def __reduce__(self):
        return (PWNED.append, ("code ran",))


def test_pickle_that_is_not_plain_tensors_is_refused(tmp_path):
    tensors = write_medusa(tmp_path, TINY, "pt")
    torch.save({**tensors, "extra": Payload()}, tmp_path / "medusa_lm_head.pt")
    with pytest.raises(CorruptCheckpointError, match="not a pickle of plain tensors") as err:
        load_heads(tmp_path)
    assert "weights_only" in str(err.value) and "save_file" in str(err.value)
    assert not PWNED
    torch.save([torch.zeros(2)], tmp_path / "medusa_lm_head.pt")
    with pytest.raises(CorruptCheckpointError, match="not a mapping"):
        load_heads(tmp_path)


def test_unknown_layout_lists_what_was_found_and_expected(tmp_path):
    _save(tmp_path, {"encoder.proj.weight": torch.zeros(2, 2)}, {"model_type": "bert"}, "model.safetensors")
    with pytest.raises(UnknownLayoutError) as err:
        load_heads(tmp_path)
    text = str(err.value)
    assert "encoder.proj.weight" in text and "model.safetensors" in text
    assert "Medusa-1" in text and "EAGLE-1" in text and "EAGLE-3" in text and "speculators" in text


def test_target_mismatch_names_both_values(tmp_path):
    write_eagle1(tmp_path / "e1", TINY)
    with pytest.raises(HeadsMismatchError, match="hidden size 32.*this target has 576"):
        load_heads(tmp_path / "e1", target_for("eagle1-smollm2"))
    write_medusa(tmp_path / "m", {**TINY, "vocab": 100})
    with pytest.raises(HeadsMismatchError, match="vocab size 100.*this target has 96"):
        load_heads(tmp_path / "m", tiny_target("llama"))
    write_eagle3(tmp_path / "q", TINY, "speculators")
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    config["speculators_config"]["verifier"]["architectures"] = ["Qwen2ForCausalLM"]
    (tmp_path / "q" / "config.json").write_text(json.dumps(config))
    with pytest.raises(HeadsMismatchError, match="Qwen2ForCausalLM.*LlamaForCausalLM"):
        load_heads(tmp_path / "q", target_for("eagle3-speculators"))


def test_eagle3_without_layer_ids_needs_the_target(tmp_path):
    write_eagle3(tmp_path / "p", TINY, "original")
    with pytest.raises(ValueError, match="--target"):
        convert_heads(tmp_path / "p", tmp_path / "out")


def test_cli_convert_and_export(tmp_path, capsys):
    assert {"convert", "export"} <= set(cli.COMMANDS)

    write_eagle3(tmp_path / "p", TINY, "speculators")
    assert cli.main(["convert", str(tmp_path / "p"), str(tmp_path / "ours")]) == 0
    assert cli.main(["export", "--to", "sglang", str(tmp_path / "ours"), str(tmp_path / "sg")]) == 0
    assert (tmp_path / "sg" / "model.safetensors").is_file()
    write_medusa(tmp_path / "m", TINY)
    assert cli.main(["convert", str(tmp_path / "m"), str(tmp_path / "m-ours")]) == 0
    capsys.readouterr()
    # a user error: one line naming the problem and the fix, exit status 2, no traceback
    assert cli.main(["export", "--to", "vllm", str(tmp_path / "m-ours"), str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("selfdraft export: ") and "Medusa" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    with pytest.raises(ExportError):  # --debug shows the traceback instead
        cli.main(["export", "--debug", "--to", "vllm", str(tmp_path / "m-ours"), str(tmp_path / "bad")])


def test_fresh_eagle3_layout_heads_decode_and_export(tmp_path):
    """Heads built (not converted) in the EAGLE-3 layout run losslessly and export for both engines."""
    target = target_for("eagle3-original")
    config = HeadsConfig.for_target(
        target.config,
        head_kind="eagle",
        eagle_layout="eagle3",
        feature_layers=[2, 4, 5],
        draft_vocab_size=40,
        eagle_fc_bias=False,
    )
    heads = build_heads(config).attach(target)
    heads.init_projection_from_target()
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.05 * torch.randn_like(p))
    prompt = torch.tensor([[4, 9, 33, 2, 71]])
    out = SelfDraftModel(target, None, heads, tree="small").generate(
        prompt, max_new_tokens=12, stop_token_ids=[]
    )
    assert out.tokens == greedy_reference(target, prompt, 12)
    ours = save_heads(heads, tmp_path / "ours")
    for engine in ("vllm", "sglang"):
        exported = export_heads(ours, tmp_path / engine, engine, verifier_name_or_path="org/tiny", target=target)
        back = load_heads(exported, target)
        for (n1, a), (n2, b) in zip(heads.state_dict().items(), back.state_dict().items(), strict=True):
            assert n1 == n2 and torch.equal(a, b)
