"""The llama.cpp engine: GGUF files run quantized through llama-cpp-python's low-level API,
with Phasewise's own loop, clock, sampler, prefix cache and batching. Importing this package
does not load llama.cpp; loading a model does."""
