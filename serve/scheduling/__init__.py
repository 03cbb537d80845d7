"""Which sequences run each step and where their KV lives: the scheduler, the block manager (paged
KV, prefix caching, swap), recurrent-state slots for hybrid models, and the eviction policies
(sliding window, StreamingLLM). Decides only; the runner applies its block and state ops."""
