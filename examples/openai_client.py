"""The unmodified OpenAI Python client against the gateway (`pip install openai`; the test
requirements pin it).

    python examples/openai_client.py       # CDE_BASE_URL, default http://127.0.0.1:8000 (the launcher's)
"""

import os

from openai import OpenAI

base_url = os.environ.get("CDE_BASE_URL", "http://127.0.0.1:8000")
client = OpenAI(base_url=f"{base_url}/v1", api_key=os.environ.get("CDE_API_KEY", "unused"))
reply = client.chat.completions.create(model="steerling-small", max_tokens=64, seed=1,
                                       messages=[{"role": "user", "content": "hi"}])
print(reply.choices[0].message.content)
print("finish:", reply.choices[0].finish_reason, "usage:", reply.usage)
