"""EAGLE-3 heads, the layout selfdraft trains by default and engines serve: the published network
(module), checkpoints of other projects (convert) and the vLLM / SGLang formats (export)."""
