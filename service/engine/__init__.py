"""The engine: one worker thread that owns the model and the device (`core`), with its parts apart:
admission (queue bound, reservations), the batching policy (pure functions), the per-request runtime state,
the generations' per-step work, the embedding batches, the prompt reuse before prefills, the model runner
(device tensors, batched prefill and decode calls) and the embedding backends (torch, onnxruntime).

May import the prefix cache, observability, text and the shared base; never the HTTP side (`service.api`)."""
