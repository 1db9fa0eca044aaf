"""The target's inference engines behind one interface; target_service/server.py knows only base.TargetBackend.

    base.py         the interface an engine implements (TargetBackend) and its exactness contract
    torch.py        PyTorch on any Hugging Face model: tree speculation, KV export
    torch_tree.py   the torch engine's tree verification (one forward over the token tree)
    llamacpp.py     llama.cpp on a GGUF, the fastest on a CPU
    llama_cache.py  how the llama.cpp engine's KV cache is sized
    llama_steps.py  the llama.cpp engine's step loop: continuous batching of decode streams, verifies, prompt pieces
    llama_prompt.py the llama.cpp engine's prompt context: prompts in the fast tiled kernel, moved into the main cache
    batching.py     the torch engine's verify batcher, and target-only decoding as verify steps
    jobs.py         shared: a verify step as the batcher sees it (VerifyJob, VerifyOutcome)
    profile.py      shared: the forward-cost profile the draft-length policy reads
    select.py       `--engine`: which engine serves, and building it

A third engine is one new file here plus a line in select.py.
"""
