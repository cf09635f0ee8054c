"""The runtime-neutral core: what a reply is and how it is decoded, whatever runs the model.

reply.py   a request's state (sampler, detokenizer, stops, timeline) and the per-token step
prompt.py  a request's prompt: tokenized, fitted to the context
solo.py    the loop for one request alone (plain and speculative), over a SoloRunner
"""
