#!/usr/bin/env bash
# Device check of the training precision path: one process per ZeRO stage (1 and 3) trains EAGLE-3 heads
# on a tiny random Llama with train.precision auto (bf16 on a CUDA GPU), evaluates and saves; then the
# logs are checked (dtype, device, finite losses) and the saved heads are loaded back.
# Needs no network and no embedded package: the tokenizer is a word-level one built here.
# Works on a CPU machine too (auto then follows the CPU's bf16 support); on a GPU it asserts cuda.
#   scripts/gpu_check.sh [python]        work folder: ${OUT:-/tmp}/gpu_check   (~1 min on a GPU)
set -euo pipefail
PY=${1:-python3}
WORK=${OUT:-/tmp}/gpu_check
rm -rf "$WORK" && mkdir -p "$WORK"
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

"$PY" - "$WORK" <<'EOF'
import json, random, sys
from pathlib import Path

import torch
import yaml
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

work = Path(sys.argv[1])
words = [f"w{i}" for i in range(200)]
tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<unk>", "<s>", "</s>", *words])}, unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
AutoModelForCausalLM.from_config(cfg).save_pretrained(work / "target")
fast.save_pretrained(work / "target")
rng = random.Random(0)
with (work / "texts.jsonl").open("w") as fh:
    for i in range(64):  # each row its own walk (stride i + 1): rows sharing their 3-grams would be
        start = rng.randrange(200)  # near-duplicates, which the split keeps together (nothing held out)
        walk = [words[(start + (i + 1) * k) % 200] for k in range(48)]
        fh.write(json.dumps({"id": f"t{i}", "text": " ".join(walk)}) + "\n")
root = Path.cwd()
for stage in (1, 3):
    config = {
        "target": str(work / "target"), "output_dir": str(work / f"run{stage}"),
        "deepspeed": str(root / f"configs/deepspeed/zero{stage}.json"),
        # the default users train (EAGLE-3 layout): it fuses three distinct layers, so name three of 0..3
        "heads": {"kind": "eagle", "draft_vocab_size": 128, "feature_layers": [1, 2, 3]},
        "data": {"sources": [str(work / "texts.jsonl")], "max_length": 48, "heldout_fraction": 0.1},
        "train": {"max_steps": 6, "micro_batch_size": 4, "gradient_accumulation_steps": 2, "lr": 0.01,
                  "warmup_steps": 1, "ttt_steps": 2, "precision": "auto"},
        "schedule": {"save_every": 3, "eval_every": 3, "log_every": 1, "eval_examples": 8},
    }
    (work / f"zero{stage}.yaml").write_text(yaml.safe_dump(config))
EOF

for stage in 1 3; do
  echo "== ZeRO-$stage"
  # the recipe is read once, by prepare, which writes the run's resolved config; the worker reads that
  "$PY" -m selfdraft.scripts.cli prepare --config "$WORK/zero$stage.yaml"
  "$PY" -m selfdraft.training.train --config "$WORK/run$stage/resolved.yaml"
done

"$PY" - "$WORK" <<'EOF'
import json, math, sys
from pathlib import Path

import torch

from selfdraft.heads import load_heads
from selfdraft.target import load_target

work = Path(sys.argv[1])
cuda = torch.cuda.is_available()
for stage in (1, 3):
    log = [json.loads(line) for line in (work / f"run{stage}" / "log.jsonl").read_text().splitlines()]
    start, losses = log[0], [r["loss"] for r in log if "loss" in r]
    evals = [r["eval_loss"] for r in log if "eval_loss" in r]
    print(f"ZeRO-{stage}: device={start['device']} precision={start['precision']} losses={losses} eval={evals}")
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses + evals), losses
    assert len(evals) == 2, f"ZeRO-{stage}: {len(evals)} evaluations, want 2 (is anything held out?)"
    if cuda:
        assert start["device"].startswith("cuda") and start["precision"] == "bfloat16", start
    target, _ = load_target(str(work / "target"))
    heads = load_heads(work / f"run{stage}" / "heads", target)
    assert all(torch.isfinite(p).all() for p in heads.parameters())

# generate with the trained heads where the training ran (CUDA when present), greedy identity there
from selfdraft.inference import SelfDraftModel

device = "cuda" if cuda else "cpu"
for dtype in (torch.float32, torch.bfloat16):
    target, _ = load_target(str(work / "target"), dtype=dtype, device=device)
    model = SelfDraftModel.with_heads(target, None, str(work / "run1" / "heads"), tree="dynamic")
    prompt = torch.tensor([[3, 10, 11, 12, 13, 14]], device=device)
    out = model.generate(prompt, 24, stop_token_ids=[])
    ref = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24,
                          do_sample=False, eos_token_id=None, pad_token_id=0)[0, prompt.shape[1]:].tolist()
    same = out.tokens == ref
    print(f"generate on {device} {dtype}: tau {out.stats.mean_accepted:.2f}, identical to target.generate: {same}")
    if dtype == torch.float32:
        assert same, (out.tokens, ref)
    sampled = model.generate(prompt, 16, temperature=1.0, seed=0, stop_token_ids=[])
    assert len(sampled.tokens) == 16
print("gpu_check: OK")
EOF
