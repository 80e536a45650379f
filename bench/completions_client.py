"""One call to a running server's `/v1/completions`, for the bench scripts beside this file."""

import json
import urllib.request


def complete(base_url, body):
    """The JSON answer to `body` posted to `base_url`'s `/v1/completions`."""
    request = urllib.request.Request(
        base_url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request) as response:
        return json.loads(response.read())
