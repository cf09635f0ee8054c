"""The torch runtime: Hugging Face folders (and GGUFs converted once) on torch, GPU first; its
runner, KV store (DynamicCache), batcher, side prefill, draft models and CPU kernel choice.
Imports the core, never the llama.cpp runtime."""
