"""What OpenAI and llama-cpp-python clients see: request names mapped onto `Engine.request` and
results into their response shapes (`responses`), and tool calls (`toolcalls`). `via_edge.compat`
(llama-cpp-python's `Llama` on an engine) answers through them."""
