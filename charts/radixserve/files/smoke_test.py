"""The chart's `helm test` (and deploy/pod_test.py): list the models, then ask the first one
for a chat completion of MAX_TOKENS tokens (default 1). Standard library only: it runs in the
server image, whose root filesystem is read-only."""

import json
import os
import sys
import urllib.request

BASE_URL = os.environ["BASE_URL"]
API_KEY = os.environ.get("API_KEY")
MAX_TOKENS = int(os.environ.get("MAX_TOKENS", "1"))
PROMPT = os.environ.get("PROMPT", "What is the capital of France?")


def call(path, body=None):
    headers = {"Content-Type": "application/json"}
    if API_KEY:
        headers["Authorization"] = f"Bearer {API_KEY}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(BASE_URL + path, data=data, headers=headers)
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.load(response)


models = [model["id"] for model in call("/v1/models")["data"]]
print("models:", models)
reply = call(
    "/v1/chat/completions",
    {
        "model": models[0],
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    },
)
print(
    "completion:", json.dumps(reply["choices"][0]["message"]["content"]), "usage:", reply["usage"]
)
if reply["usage"]["completion_tokens"] < 1:
    sys.exit("the completion has no tokens")
