"""Code written for llama-cpp-python's Llama keeps working: same call, same response shape."""

from via_edge.compat import Llama  # was: from llama_cpp import Llama

llm = Llama.from_pair("qwen2.5-coder")  # or, as before: Llama(model_path="model.gguf", n_ctx=4096)
out = llm.create_chat_completion(messages=[{"role": "user", "content": "Name three sorting algorithms."}],
                                 max_tokens=64, temperature=0)
print(out["choices"][0]["message"]["content"])
print(out["usage"], out["timings"]["mode"], out["timings"]["copied_n"], "tokens copied from the context")
for chunk in llm("def quicksort(xs):", max_tokens=48, temperature=0, stream=True):
    print(chunk["choices"][0]["text"], end="", flush=True)
print()
llm.close()
