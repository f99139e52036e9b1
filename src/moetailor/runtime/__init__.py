"""One forward per engine step: the step a forward reads, the runner that builds it over the paged KV
pool, the engine's decoders (one per model family, prefill and decode alike), attention and the
experts implementation."""
