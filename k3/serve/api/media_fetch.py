"""Fetching remote images for chat requests, off unless the server is started with
`--allow-remote-images` or `--allowed-media-domains` (vLLM's flag name).

A server that fetches what a request names can be pointed at hosts its users cannot reach
themselves (server-side request forgery), so k3 fetches nothing by default, and when it does:
- only http and https, and with `--allowed-media-domains` only those host names (exactly,
  case-insensitively), checked again on every redirect (at most MAX_REDIRECTS);
- one deadline for the whole fetch (`--media-fetch-timeout`), not only per socket read, so a
  server that drips bytes cannot hold a worker thread;
- at most the image size limit in bytes, stopped as soon as it is passed;
- no cookies, no credentials, no proxies from the environment: a fetch carries nothing of the
  server's own.
The bytes are then decoded and checked exactly like a `data:` URI's (k3.serve.api.images)."""
from __future__ import annotations

import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from urllib.parse import urlsplit

MAX_REDIRECTS = 3
READ_CHUNK = 64 << 10
USER_AGENT = "k3-media-fetch"


class FetchError(ValueError):
    """A remote image or video that cannot be fetched (the server answers 400 naming the part)."""


@dataclass(frozen=True)
class FetchPolicy:
    allowed_domains: frozenset[str] | None = None  # None: any host
    timeout: float = 5.0  # seconds for the whole fetch, redirects included
    max_bytes: int = 16 << 20

    def __post_init__(self):
        if not self.timeout > 0:
            raise ValueError(f"media fetch timeout must be > 0 seconds, got {self.timeout}")
        if self.allowed_domains is not None:
            object.__setattr__(self, "allowed_domains", frozenset(d.strip().lower().rstrip(".")
                                                                  for d in self.allowed_domains if d.strip()))
            if not self.allowed_domains:
                raise ValueError("--allowed-media-domains needs at least one host name")

    def check(self, url: str) -> None:
        """FetchError unless `url` is http(s) on an allowed host."""
        parts = urlsplit(url)
        if parts.scheme.lower() not in ("http", "https"):
            raise FetchError(f"only http and https image URLs are fetched, not {parts.scheme or 'a relative URL'!r}")
        host = (parts.hostname or "").lower().rstrip(".")
        if not host:
            raise FetchError("the image URL has no host")
        if self.allowed_domains is not None and host not in self.allowed_domains:
            raise FetchError(f"host {host!r} is not in --allowed-media-domains")


class _Redirects(urllib.request.HTTPRedirectHandler):
    max_redirections = MAX_REDIRECTS

    def __init__(self, policy: FetchPolicy):
        self.policy = policy

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        self.policy.check(newurl)  # a redirect must not lead off the allowed hosts
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def fetch(url: str, policy: FetchPolicy) -> bytes:
    """The bytes at `url` under `policy`; FetchError in one line for anything that goes wrong."""
    policy.check(url)
    deadline = time.monotonic() + policy.timeout
    # ProxyHandler({}): ignore $http_proxy, so the allow-list is about the host actually reached
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), _Redirects(policy))
    request = urllib.request.Request(url, headers={"User-Agent": USER_AGENT, "Accept": "image/png, image/jpeg"})
    try:
        with opener.open(request, timeout=policy.timeout) as response:
            length = response.headers.get("Content-Length")
            if length is not None and length.isdigit() and int(length) > policy.max_bytes:
                raise FetchError(f"the image is {int(length):,} bytes, over the limit of {policy.max_bytes:,}")
            chunks, size = [], 0
            while True:
                if time.monotonic() > deadline:
                    raise FetchError(f"fetching the image took longer than {policy.timeout:g} s")
                chunk = response.read1(READ_CHUNK)  # what has arrived: read() would wait to fill it
                if not chunk:
                    break
                size += len(chunk)
                if size > policy.max_bytes:
                    raise FetchError(f"the image is over the limit of {policy.max_bytes:,} bytes")
                chunks.append(chunk)
    except FetchError:
        raise
    except urllib.error.HTTPError as e:
        if 300 <= e.code < 400:  # urllib gives up on a loop or past max_redirections
            raise FetchError(f"fetching the image failed: more than {MAX_REDIRECTS} redirects, or a loop") from None
        raise FetchError(_one_line(f"fetching the image failed: HTTP {e.code} {e.reason}")) from None
    except urllib.error.URLError as e:
        reason = e.reason
        if isinstance(reason, FetchError):  # raised by the redirect check inside urllib
            raise reason from None
        raise FetchError(_one_line(f"fetching the image failed: {reason}")) from None
    except TimeoutError:
        raise FetchError(f"fetching the image took longer than {policy.timeout:g} s") from None
    except (OSError, ValueError) as e:
        raise FetchError(_one_line(f"fetching the image failed: {type(e).__name__}: {e}")) from None
    return b"".join(chunks)


def _one_line(text: str) -> str:
    return " ".join(text.split())
