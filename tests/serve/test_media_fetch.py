"""Remote image fetching (k3.serve.api.media_fetch): off by default; when on, http(s) only, the
allowed hosts checked on every redirect, one deadline for the whole fetch, a byte limit, and every
failure one line (the server turns it into a 400 naming the part: tests/serve/test_images.py)."""
from __future__ import annotations

import argparse
import http.server
import io
import threading
import time
from contextlib import contextmanager

import pytest
from PIL import Image

from k3.serve.api.images import ImageError, decode_image_url
from k3.serve.api.media_fetch import FetchError, FetchPolicy, fetch
from k3.serve.cli import add_arguments, media_fetch_policy


def png_bytes(size=(20, 10), colour=(200, 30, 40)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


class _Handler(http.server.BaseHTTPRequestHandler):

    def log_message(self, *args):  # quiet test output
        pass

    def do_GET(self):
        port = self.server.server_address[1]
        route = self.path.split("?")[0]
        if route == "/ok.png":
            self._send(200, png_bytes())
        elif route == "/text":
            self._send(200, b"hello, not an image", "text/plain")
        elif route == "/big":  # declares more than any test limit
            self.send_response(200)
            self.send_header("Content-Length", str(1 << 30))
            self.end_headers()
        elif route == "/chunked-big":  # no Content-Length: the limit must stop the read itself
            self.send_response(200)
            self.end_headers()
            try:
                for _ in range(64):
                    self.wfile.write(b"\0" * 4096)
            except OSError:
                pass
        elif route == "/drip":  # one byte at a time: each read is quick, the whole fetch is not
            self.send_response(200)
            self.end_headers()
            try:
                for _ in range(100):
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(0.05)
            except OSError:
                pass
        elif route == "/to-ok":
            self._redirect(f"http://127.0.0.1:{port}/ok.png")
        elif route == "/to-other-host":  # the same server under another name: not on the allow-list
            self._redirect(f"http://localhost:{port}/ok.png")
        elif route == "/loop":
            self._redirect(f"http://127.0.0.1:{port}/loop")
        else:
            self._send(404, b"no such file", "text/plain")

    def _send(self, code, body, ctype="image/png"):
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _redirect(self, url):
        self.send_response(302)
        self.send_header("Location", url)
        self.send_header("Content-Length", "0")
        self.end_headers()


@contextmanager
def image_host():
    """A local HTTP server in a thread; yields its base URL (http://127.0.0.1:PORT)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def host():
    with image_host() as url:
        yield url


LOCAL = FetchPolicy(frozenset({"127.0.0.1"}), timeout=2.0, max_bytes=64 << 10)


def test_fetches_an_allowed_image(host):
    assert fetch(f"{host}/ok.png", LOCAL) == png_bytes()
    assert fetch(f"{host}/to-ok", LOCAL) == png_bytes()  # a redirect that stays on allowed hosts
    assert fetch(f"{host}/ok.png", FetchPolicy(timeout=2.0)) == png_bytes()  # any host


@pytest.mark.parametrize("path, policy, message", [
    ("/missing.png", LOCAL, "HTTP 404"),
    ("/to-other-host", LOCAL, "host 'localhost' is not in --allowed-media-domains"),
    ("/loop", LOCAL, "fetching the image failed"),  # too many redirects
    ("/big", LOCAL, "over the limit of 65,536"),
    ("/chunked-big", LOCAL, "over the limit of 65,536 bytes"),
    ("/drip", FetchPolicy(frozenset({"127.0.0.1"}), timeout=0.5), "took longer than 0.5 s"),
])
def test_each_failure_is_one_line(host, path, policy, message):
    t0 = time.monotonic()
    with pytest.raises(FetchError) as e:
        fetch(host + path, policy)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert time.monotonic() - t0 < 4  # the deadline holds even against a server that drips bytes


@pytest.mark.parametrize("url, message", [
    ("http://example.com/cat.png", "host 'example.com' is not in --allowed-media-domains"),
    ("ftp://127.0.0.1/cat.png", "only http and https"),
    ("http:///cat.png", "has no host"),
])
def test_refused_before_any_connection(url, message):
    with pytest.raises(FetchError, match=message):
        fetch(url, LOCAL)


def test_decoded_like_an_inline_image(host):
    """A fetched file is checked as a data: URI's bytes would be: format from the bytes, pixel limit."""
    decoded = decode_image_url(f"{host}/ok.png", "part", max_pixels=10_000, fetch_policy=LOCAL)
    assert decoded.image.size == (20, 10)
    with pytest.raises(ImageError, match="part: the image could not be decoded"):
        decode_image_url(f"{host}/text", "part", max_pixels=10_000, fetch_policy=LOCAL)
    with pytest.raises(ImageError, match="over the limit of 100"):
        decode_image_url(f"{host}/ok.png", "part", max_pixels=100, fetch_policy=LOCAL)
    with pytest.raises(ImageError, match="part: remote image URLs are not fetched"):
        decode_image_url(f"{host}/ok.png", "part", max_pixels=10_000)  # no policy: off


def test_serve_flags():
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert media_fetch_policy(p.parse_args(["--run", "r"])) is None  # off by default
    policy = media_fetch_policy(p.parse_args(["--run", "r", "--allowed-media-domains", "Images.Example.com.",
                                              "cdn.example.org", "--media-fetch-timeout", "2"]))
    assert policy.allowed_domains == {"images.example.com", "cdn.example.org"} and policy.timeout == 2
    assert media_fetch_policy(p.parse_args(["--run", "r", "--allow-remote-images"])).allowed_domains is None
    with pytest.raises(ValueError, match="exclude each other"):
        media_fetch_policy(p.parse_args(["--run", "r", "--allow-remote-images", "--allowed-media-domains", "a.com"]))
    with pytest.raises(ValueError, match="must be > 0"):
        media_fetch_policy(p.parse_args(["--run", "r", "--allow-remote-images", "--media-fetch-timeout", "0"]))
