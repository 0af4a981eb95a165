"""Talk to `via-edge serve` with the official openai client (start the server first:
    .venv/bin/via-edge serve --mode sd
)."""

import openai

client = openai.OpenAI(base_url="http://127.0.0.1:8080/v1", api_key="unused")
model = client.models.list().data[0].id
reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "What is a mutex?"}],
                                       max_tokens=64, temperature=0)
print(reply.choices[0].message.content)
print("speculation:", reply.model_extra["timings"])
for chunk in client.chat.completions.create(model=model, stream=True, max_tokens=48,
                                            messages=[{"role": "user", "content": "Write a haiku about RAM."}]):
    print(chunk.choices[0].delta.content or "", end="", flush=True)
print()
