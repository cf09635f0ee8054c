"""Every constant of the engine's schedule, in one place, with the measurement that chose it.

The schedule decides, each engine step, what runs: how many rows decode together, and how a
joining prompt is read: alone in whole chunks (nothing streams), in chunks between or inside
the streaming rows' steps, or beside them on a thread of its own. Both runtimes read these;
where a runtime's mechanism differs (torch steps between chunks, llama.cpp puts a chunk inside
the rows' llama_decode) its constant says so.
"""

from __future__ import annotations

MAX_BATCH = 8  # rows decoding at once; later requests wait in the queue

# ----- a prompt read alone ----------------------------------------------------------------------
# torch: prompt tokens per prefill forward. On the Xeon VM (SmolLM2-135M, fp32, a 2,048-token
# prompt, one thread of a shared machine, best of 2) chunks of 128 / 256 / 512 kept 76% / 87% /
# 92% of one pass's tokens per CPU-second; 256 keeps progress and Stop within about half a second
# (~0.55-0.8 s a chunk at this CPU's 2-thread prefill rate), 512 would double that. A GPU takes
# big chunks at no cost.
CPU_PREFILL_CHUNK = 256
GPU_PREFILL_CHUNK = 2048
PREFILL_CHUNK_ENV = "PHASEWISE_PREFILL_CHUNK"  # overrides both (tokens)
# llama.cpp: a lone prompt goes in whole batches (n_batch), with progress and Stop from inside
# each (a graph meter): on the Xeon VM a lone 4,000-token prompt ran at 124-138 tok/s so,
# against 108-114 in chunks sized by the clock to 0.4 s (benchmarks/prefill_progress.py, the two
# builds alternating). Until a meter has seen the graph's size, a lone chunk is FIRST_LONE_CHUNK,
# short enough that its end is the first progress (16 tokens: ~70 ms at an empty context).
FIRST_LONE_CHUNK = 16

# ----- a prompt read while rows stream -----------------------------------------------------------
# torch, chunks between the rows' steps: each engine step spends a token budget, one decode token
# per row plus a prefill chunk (Sarathi-Serve). The budget starts at STEP_TOKEN_BUDGET and then
# follows the clock, so that a chunk takes about CHUNK_STALL decode steps. On a CPU a chunk also
# pays a fixed cost (all weights read, attention and KV copies over the whole cached prompt): on
# the Xeon VM an 8-token chunk at 4,000 tokens of context cost 2.5-3.5 decode steps and a
# 32-token one 3.5-5, so smaller chunks stop helping ITL while the prompt crawls (8: 10 tok/s
# against 103 in one pass).
STEP_TOKEN_BUDGET = 32
CHUNK_STALL = 1.0
MIN_INTERLEAVED_CHUNK = 32
# llama.cpp, a chunk inside the rows' llama_decode: the mixed step aims at STEP_STALL plain
# decode steps, so a streaming row's ITL stays about that multiple of its ITL alone (the target
# of issue 18 is 2.5 at p99: the rest is headroom for noise). A prompt token costs more as the
# prompt's context grows (attention over it), so the clock shrinks the chunk as the prompt goes.
STEP_STALL = 1.8
FIRST_MIXED_CHUNK = 4  # tokens, before a mixed step has been timed

# ----- a prompt read beside the streaming rows (a side thread, both runtimes) --------------------
# Shorter prompts stay between or inside the steps: a side thread (and on llama.cpp a side
# context, ~50 ms to make) is not worth a chunk or so.
SIDE_MIN_TOKENS = 256
# Side chunks follow the clock so that progress, Stop and a change of the side's thread count
# come about every SIDE_CHUNK_S. On the Xeon VM (torch, one core each, bench --interference,
# 4,000 tokens) 256-token chunks took ~1.3 s at 197-242 tok/s; sized to 0.5 s the prompt ran at
# 174 tok/s, to 0.4 s at 141, against 156-165 for chunks between the steps (each chunk's ~600 ops
# also wait for the GIL). llama.cpp's side chunks also report progress from inside (a meter).
SIDE_CHUNK_S = 0.5
FIRST_SIDE_CHUNK = 64  # small, so the first progress comes soon; then the clock
MIN_SIDE_CHUNK = 64
SIDE_POLL_S = 0.05  # with no row streaming, how often the engine thread looks at the side


def chunk_for(tokens: int, seconds: float, target_s: float, lowest: int, highest: int) -> int:
    """The next prefill chunk after one of `tokens` took `seconds`: as many tokens as that rate
    runs in target_s, within [lowest, highest] (a chunk sized by the clock, so progress and
    Stop come about every target_s whatever the machine)."""
    return max(lowest, min(highest, round(tokens / seconds * target_s)))


def next_side_chunk(tokens: int, seconds: float, highest: int) -> int:
    """The next side prefill chunk after one of `tokens` took `seconds` (at most `highest`)."""
    if seconds <= 0:
        return MIN_SIDE_CHUNK
    return chunk_for(tokens, seconds, SIDE_CHUNK_S, MIN_SIDE_CHUNK, highest)
