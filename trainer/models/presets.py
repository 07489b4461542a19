"""Built-in GPT sizes (torch-free, so the config can check shapes without importing torch)."""

PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(n_layer=4, n_head=4, n_embd=128),
    "gpt2-small": dict(n_layer=12, n_head=12, n_embd=768),  # 124M with vocab 50304
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),  # 350M with vocab 50304
}
