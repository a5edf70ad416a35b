"""A minimal prefill/decode router for two `vllm serve` instances using KVSidecarConnector.

    python examples/pd_router.py --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

For each OpenAI completion or chat completion request it:
  1. sends a copy to the prefill server with max_tokens=1 (max_completion_tokens too) and
     kv_transfer_params {"do_remote_decode": true}: the prefill computes the prompt's KV
     cache and publishes it through its node's kv-sidecar;
  2. takes kv_transfer_params from the prefill's response (the sidecar's transfer params,
     which it passes on untouched) and sends the original request with them to the decode
     server, whose sidecar pulls the KV cache and which then generates;
  3. returns the decode server's answer (streamed through if the client asked for a stream).

If the prefill fails, the request goes to the decode server without kv_transfer_params and is
computed there. Standard library only; one thread per request. A production router adds
load balancing, retries and health checks; the KV handoff is no more than this.
"""

from __future__ import annotations

import argparse
import json
import logging
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger("pd_router")
ROUTES = ("/v1/completions", "/v1/chat/completions")


def post(url: str, body: dict[str, Any], timeout_s: float) -> Any:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    return urllib.request.urlopen(req, timeout=timeout_s)


def prefill_params(prefill: str, path: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any] | None:
    """The prefill's kv_transfer_params for this request, or None (the decode then computes it all)."""
    p = dict(body, max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    if "max_completion_tokens" in p:
        p["max_completion_tokens"] = 1
    p.pop("stream_options", None)
    try:
        with post(prefill + path, p, timeout_s) as resp:
            return json.load(resp).get("kv_transfer_params")
    except (urllib.error.URLError, OSError, ValueError) as e:
        log.warning("prefill failed (%s): the decode server computes the whole request", e)
        return None


class Router(BaseHTTPRequestHandler):
    prefill = ""
    decode = ""
    timeout_s = 600.0

    def do_POST(self) -> None:
        if self.path not in ROUTES:
            self.send_error(404, f"routes: {', '.join(ROUTES)}")
            return
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        except ValueError:
            self.send_error(400, "body is not JSON")
            return
        params = prefill_params(self.prefill, self.path, body, self.timeout_s)
        if params:
            body = dict(body, kv_transfer_params=params)
        try:
            resp = post(self.decode + self.path, body, self.timeout_s)
        except urllib.error.HTTPError as e:
            resp = e  # pass the decode server's error through as it is
        with resp:
            self.send_response(resp.status)
            self.send_header("Content-Type", resp.headers.get("Content-Type", "application/json"))
            self.end_headers()
            while chunk := resp.read1(65536) if hasattr(resp, "read1") else resp.read(65536):
                self.wfile.write(chunk)
                self.wfile.flush()

    def log_message(self, fmt: str, *args: Any) -> None:
        log.info(fmt, *args)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefill", required=True, help="base URL of the prefill vllm serve")
    ap.add_argument("--decode", required=True, help="base URL of the decode vllm serve")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--timeout-s", type=float, default=600.0)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    Router.prefill, Router.decode, Router.timeout_s = (
        args.prefill.rstrip("/"),
        args.decode.rstrip("/"),
        args.timeout_s,
    )
    server = ThreadingHTTPServer((args.host, args.port), Router)
    log.info("routing %s -> prefill %s, decode %s on :%d", ROUTES, args.prefill, args.decode, args.port)
    server.serve_forever()


if __name__ == "__main__":
    main()
