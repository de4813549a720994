"""Shared EAGLE drafting fixtures: a random-weight head after a prompt, and a cache-free reference."""

import torch

from selfdraft import kv
from selfdraft.heads import HeadsConfig, build_heads
from selfdraft.heads.eagle.drafter import EagleRows
from selfdraft.inference.decoding import prefill

from tiny_models import tiny_target


def eagle_after_prompt(arch: str, prompt_seed: int, layout: str = "eagle3"):
    """A random EAGLE head of `layout` on a tiny target that has observed a 5-token prompt.

    Returns (heads, prompt [1, 5], prefill pass, root token, a one-row drafter)."""
    torch.manual_seed(0)
    target = tiny_target(arch)
    config = HeadsConfig.for_target(target.config, head_kind="eagle", eagle_layout=layout)
    heads = build_heads(config).attach(target)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.2)
    prompt = torch.randint(0, 96, (1, 5), generator=torch.Generator().manual_seed(prompt_seed))
    passed = prefill(target, [prompt[0]], kv.new_cache())
    root = int(passed.logits[0].argmax())
    drafter = EagleRows(heads, 1)
    drafter.observe(0, torch.cat([prompt[0, 1:], torch.tensor([root])]), passed.hidden_states, torch.arange(5))
    return heads, prompt, passed, root, drafter


def input_features(head, passed) -> list:
    """The head's input feature at each prompt position (its fusion of the target's layers): [h] each."""
    with torch.no_grad():
        return list(head.fuse_features(passed.hidden_states)[0])


def reference_tokens(head, prompt_tokens, root, feats, spec, k) -> list[int]:
    """Recompute every node's token by running the head on each root-to-node path, with no cache."""
    expected_tokens = {0: root}
    for u in range(spec.size):
        if not spec.children[u]:
            continue
        path_nodes = spec.path_to(u)
        toks, fs = list(prompt_tokens[1:]) + [root], list(feats)
        out_feature = None
        # consume the prompt pairs, then each path node fed with its parent's predicted feature
        for step in range(len(path_nodes)):
            if step > 0:
                toks.append(expected_tokens[path_nodes[step]])
                fs.append(out_feature)
            ids = torch.tensor(toks)[None]
            f = torch.stack(fs)[None]
            pos = torch.arange(len(toks))[None]
            out_feature = head(ids, f, position_ids=pos)[0, -1]
        ranked = torch.topk(head.logits(out_feature), k).indices
        for c in spec.children[u]:
            expected_tokens[c] = int(ranked[spec.ranks[c]])
    return [expected_tokens[i] for i in range(spec.size)]
