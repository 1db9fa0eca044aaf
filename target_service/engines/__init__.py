"""The target's inference engines: one interface (base.TargetBackend), a PyTorch and a llama.cpp backend."""
