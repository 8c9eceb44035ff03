"""Downloading an image over http(s), from the allowed hosts only: redirects are followed only to allowed
hosts, the body is read up to the byte limit and the download must end within the time limit."""

from __future__ import annotations

import threading
import time

import httpx

from quire.core.errors import ValidationError

MAX_REDIRECTS = 5
_CHUNK_BYTES = 64 * 1024


class ImageFetcher:
    """``fetch(url, param)``: the bytes at ``url``, or a ``ValidationError`` naming ``param``. With no
    allowed hosts (the default) no URL is ever requested."""

    def __init__(self, allowed_domains: tuple[str, ...], max_bytes: int, timeout: float):
        self.allowed_domains = frozenset(domain.lower() for domain in allowed_domains)
        self.max_bytes = max_bytes
        self.timeout = timeout
        self._client: httpx.Client | None = None
        self._lock = threading.Lock()

    def fetch(self, url: str, param: str) -> bytes:
        if not self.allowed_domains:
            raise ValidationError(f"{param}: this server fetches no image URLs (it was started without "
                                  "--allowed-media-domains); send the image inline as a data: URL", param=param)
        deadline = time.monotonic() + self.timeout
        target = self._allowed_url(url, param)
        for _ in range(MAX_REDIRECTS + 1):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._timed_out(param)
            try:
                with self._http().stream("GET", target, timeout=remaining) as response:
                    if response.is_redirect:
                        target = self._allowed_url(str(target.join(response.headers["location"])), param)
                        continue
                    if response.status_code != 200:
                        raise ValidationError(f"{param}: the image URL answered HTTP {response.status_code}",
                                              param=param)
                    return self._read(response, deadline, param)
            except httpx.TimeoutException:
                raise self._timed_out(param) from None
            except httpx.HTTPError as error:
                raise ValidationError(f"{param}: the image could not be downloaded ({type(error).__name__})",
                                      param=param) from None
        raise ValidationError(f"{param}: the image URL redirected more than {MAX_REDIRECTS} times", param=param)

    def _allowed_url(self, url: str, param: str) -> httpx.URL:
        """The URL as httpx will request it, if its scheme is http(s) and its host is allowed (the same parse
        decides both, so what is checked is what is fetched)."""
        try:
            parsed = httpx.URL(url)
        except (httpx.InvalidURL, ValueError, TypeError):
            raise ValidationError(f"{param} is not a valid URL", param=param) from None
        if parsed.scheme not in ("http", "https"):
            raise ValidationError(f"{param}: only http(s) URLs are fetched", param=param)
        if parsed.host.lower() not in self.allowed_domains:
            raise ValidationError(f"{param}: the host {parsed.host!r} is not among this server's allowed media "
                                  "domains", param=param)
        return parsed

    def _read(self, response: httpx.Response, deadline: float, param: str) -> bytes:
        declared = response.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            raise self._too_large(param)
        chunks, size = [], 0
        for chunk in response.iter_bytes(_CHUNK_BYTES):
            size += len(chunk)
            if size > self.max_bytes:
                raise self._too_large(param)
            if time.monotonic() > deadline:
                raise self._timed_out(param)
            chunks.append(chunk)
        return b"".join(chunks)

    def _http(self) -> httpx.Client:
        with self._lock:
            if self._client is None:
                self._client = httpx.Client(follow_redirects=False, timeout=httpx.Timeout(self.timeout))
            return self._client

    def _too_large(self, param: str) -> ValidationError:
        return ValidationError(f"{param}: the image is larger than {self.max_bytes} bytes", param=param)

    def _timed_out(self, param: str) -> ValidationError:
        return ValidationError(f"{param}: the image took longer than {self.timeout:g} s to download", param=param)
