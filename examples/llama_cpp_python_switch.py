"""Code written for llama-cpp-python's Llama keeps working: same call, same response shape."""

from via_edge.compat import Llama  # was: from llama_cpp import Llama

llm = Llama.from_pair("qwen2.5-coder", mode="sd")  # was: Llama(model_path=...)
out = llm.create_chat_completion(messages=[{"role": "user", "content": "Name three sorting algorithms."}],
                                 max_tokens=64, temperature=0)
print(out["choices"][0]["message"]["content"])
print(out["usage"], out["timings"]["draft_n_accepted"], "of", out["timings"]["draft_n"], "draft tokens accepted")
for chunk in llm.create_completion("def quicksort(xs):", max_tokens=48, temperature=0, stream=True):
    print(chunk["choices"][0]["text"], end="", flush=True)
print()
llm.close()
